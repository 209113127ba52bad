"""Retiring a replica and stopping its shards: the steps several passes share.

A stop or drain is sent once per node epoch: a reconnected node is told
again, a pass that runs twice on one stream says nothing twice.
"""

from __future__ import annotations

from collections.abc import Mapping

from llmgw.controlplane.reconcile.plan import Drain, NodeView, Plan, Stop
from llmgw.controlplane.replicas import GONE, WAITING, Replica, ReplicaBook, Shard


def retire(r: Replica, reason: str, now: float, draining: bool = False) -> None:
    r.retired, r.retire_reason, r.retired_at, r.draining = True, reason, now, draining


def replace_lost(book: ReplicaBook, r: Replica, reason: str, now: float, plan: Plan) -> None:
    """Retire ``r`` for a loss that is not its own fault and replace it at once (no backoff),
    keeping why as its slot's last failure."""
    retire(r, reason, now)
    if r.slot is not None:
        hist = book.slot(r.key, r.slot)
        hist.needs_replacement_token = True
        hist.last_failure = {"replica_id": r.replica_id, "reason": reason, "output_tail": None, "at": now}
    plan.events.append(f"{r.replica_id}: {reason}; replacing it")


def stop_shards(r: Replica, nodes: Mapping[str, NodeView], plan: Plan, reason: str, drain: bool = False) -> None:
    for s in r.shards.values():
        if s.released or s.node_id is None:
            continue
        if s.state == WAITING and s.dispatched_at is None:
            s.state = GONE  # never sent: nothing to stop, its GPUs are simply given back
            s.reason = "never started"
            continue
        stop_once(s, nodes, plan, reason, drain=drain)


def stop_once(s: Shard, nodes: Mapping[str, NodeView], plan: Plan, reason: str, drain: bool = False) -> None:
    node = nodes.get(s.node_id) if s.node_id else None
    if node is None or not node.connected:
        return  # its next registration will say whether it still runs
    if drain:
        if s.drain_epoch != node.epoch:
            s.drain_epoch = node.epoch
            plan.actions.append(Drain(node.node_id, s.shard_id))
    elif s.stop_epoch != node.epoch:
        s.stop_epoch = node.epoch
        plan.actions.append(Stop(node.node_id, s.shard_id, reason))
