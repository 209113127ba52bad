"""Garbage collection: retired replicas and strays are stopped (drained first where asked) and forgotten.

A retired replica leaves the book once every shard it placed is released;
a stray (a shard no replica owns) is told to stop once per node epoch and
forgotten when its agent reports it ended.
"""

from __future__ import annotations

from collections.abc import Mapping

from llmgw.controlplane.reconcile.plan import NodeView, Plan
from llmgw.controlplane.reconcile.stopping import stop_once, stop_shards
from llmgw.controlplane.replicas import ReplicaBook

# An operator's drain lets in-flight requests finish; after this long the
# engine is stopped regardless, so a stuck drain cannot hold GPUs forever.
DRAIN_TIMEOUT = 300.0


def clean_retired(book: ReplicaBook, nodes: Mapping[str, NodeView], now: float, plan: Plan) -> None:
    for r in [r for r in book.replicas.values() if r.retired]:
        drain = r.draining and r.retired_at is not None and now - r.retired_at < DRAIN_TIMEOUT
        stop_shards(r, nodes, plan, r.retire_reason or "retired", drain=drain)
        if r.all_released or all(s.released or s.node_id is None for s in r.shards.values()):
            book.remove(r.replica_id)
            plan.events.append(f"{r.replica_id}: gone ({r.retire_reason})")


def clean_strays(book: ReplicaBook, nodes: Mapping[str, NodeView], plan: Plan) -> None:
    for key, s in list(book.strays.items()):
        if s.released:
            book.remove_stray(key)
        else:
            stop_once(s, nodes, plan, s.reason or "not recognised by the control plane")
