"""A replica on its way up: Ready noted (its slot's failures forgiven), later ranks sent to rank 0's rendezvous.

Ranks above 0 wait until rank 0 is starting and reports its master port;
only then is each dispatched, with rank 0's address and port in its spec.
"""

from __future__ import annotations

from collections.abc import Mapping

from llmgw.controlplane.reconcile.plan import NodeView, Plan, Start
from llmgw.controlplane.replicas import PENDING, READY, STARTING, WAITING, Replica, ReplicaBook, ReplicaState


def advance(book: ReplicaBook, r: Replica, nodes: Mapping[str, NodeView], now: float, plan: Plan) -> None:
    if r.state is ReplicaState.READY:
        if r.ready_since is None:
            r.ready_since = now
            plan.events.append(f"{r.replica_id}: ready")
        if r.slot is not None:
            book.slot(r.key, r.slot).failures = 0
        return
    r.ready_since = None
    r0 = r.shards.get(0)
    if r0 is None or r0.node_id is None or r0.state not in (STARTING, READY) or not r0.master_port:
        return
    for rank in range(1, r.nnodes):
        s = r.shards[rank]
        if s.state != WAITING or s.dispatched_at is not None or s.node_id is None:
            continue
        node = nodes.get(s.node_id)
        if node is None or not node.schedulable:
            continue
        master = r0.address or (nodes[r0.node_id].address if r0.node_id in nodes else None)
        s.spec = {**s.spec, "master_addr": master, "master_port": r0.master_port}
        s.state, s.dispatched_at, s.state_since = PENDING, now, now
        plan.actions.append(Start(s.node_id, s.spec))
        plan.events.append(f"{s.shard_id}: start on {s.node_id} GPUs {list(s.gpu_indices)} "
                           f"(rendezvous {master}:{r0.master_port})")
