"""One live replica per GPU and per slot: double claims resolved, slots assigned, surplus retired."""

from __future__ import annotations

from llmgw.catalog import Deployment
from llmgw.controlplane.reconcile.plan import Plan
from llmgw.controlplane.reconcile.stopping import retire
from llmgw.controlplane.replicas import Replica, ReplicaBook, ReplicaState


def keeper_rank(r: Replica) -> tuple:
    # Which of two replicas competing for one slot to keep: one this control
    # plane placed beats one it adopted (a report, even a granted one, never
    # displaces a placement); then serving beats starting beats failed; then
    # the longer-known one.
    order = {ReplicaState.READY: 0, ReplicaState.STARTING: 1, ReplicaState.FAILED: 2}
    return (r.adopted, order.get(r.state, 3), r.created_at, r.replica_id)


def resolve_double_claims(book: ReplicaBook, now: float, plan: Plan) -> None:
    """Two live replicas holding one GPU: the keeper stays, the others are retired."""
    for node_id, gpu, ids in book.double_claims():
        owners = {}
        for s in book.shards_on(node_id):
            if s.shard_id in ids and not s.released:
                r = book.replicas.get(s.replica_id)
                if r is not None and not r.retired and r.shards.get(s.rank) is s:
                    owners[r.replica_id] = r
        if len(owners) < 2:
            continue  # at most one live replica: the others are being stopped already
        ranked = sorted(owners.values(), key=keeper_rank)
        for loser in ranked[1:]:
            retire(loser, f"GPU {gpu} on {node_id} is also held by {ranked[0].replica_id}", now)
            plan.events.append(f"{loser.replica_id}: retired, shares GPU {gpu} on {node_id} with {ranked[0].replica_id}")


def assign_slots(book: ReplicaBook, dep: Deployment, now: float, plan: Plan) -> None:
    """Each of ``dep``'s live replicas to a slot of its own; one for which none is left is surplus."""
    # A replica being started to take another's place (a node drain) has no slot
    # of its own until it is Ready and takes over the old one's.
    mine = sorted((r for r in book.live() if (r.model, r.profile) == (dep.model, dep.profile)
                   and r.surge_for is None), key=keeper_rank)
    taken: dict[int, Replica] = {}
    extras: list[Replica] = []
    for r in mine:
        if r.slot is not None and 0 <= r.slot < dep.replicas and r.slot not in taken:
            taken[r.slot] = r
        else:
            extras.append(r)
    for r in extras:
        free = next((i for i in range(dep.replicas) if i not in taken), None)
        if free is None and dep.autoscale is not None:
            # scaled down: it leaves the routers and finishes what it has before it stops
            retire(r, f"scaled down: {dep.key} needs {dep.replicas} replica(s)", now, draining=True)
            plan.events.append(f"{r.replica_id}: draining, scaled down to {dep.key} x{dep.replicas}")
        elif free is None:
            retire(r, f"surplus: {dep.key} declares {dep.replicas} replica(s)", now)
            plan.events.append(f"{r.replica_id}: stopping, surplus to {dep.key} x{dep.replicas}")
        else:
            r.slot = free
            taken[free] = r
