"""Losses that are not a replica's fault: lost nodes and GPUs withheld as sick.

A lost node's shards are let go (its next registration says what really
runs there) and its replicas replaced at once, without restart backoff; so
are replicas with a shard on a GPU its agent now withholds.
"""

from __future__ import annotations

from collections.abc import Mapping

from llmgw.controlplane.lifecycle import NodeState
from llmgw.controlplane.reconcile.plan import NodeView, Plan
from llmgw.controlplane.reconcile.stopping import replace_lost
from llmgw.controlplane.replicas import GONE, ReplicaBook


def forget_lost_nodes(book: ReplicaBook, nodes: Mapping[str, NodeView], now: float) -> None:
    # A lost node is unschedulable until it registers again, and that
    # registration reports what really runs there; until then nothing it
    # held needs guarding.
    for s in book.all_shards():
        n = nodes.get(s.node_id) if s.node_id else None
        if n is not None and n.state is NodeState.LOST and not s.released:
            s.state, s.state_since, s.progress = GONE, now, None
            s.reason = f"node {s.node_id} lost"


def retire_on_lost_nodes(book: ReplicaBook, nodes: Mapping[str, NodeView], now: float, plan: Plan) -> None:
    for r in book.live():
        lost = sorted(n for n in r.nodes() if n in nodes and nodes[n].state is NodeState.LOST)
        if lost:
            replace_lost(book, r, f"node {', '.join(lost)} lost", now, plan)


def retire_on_sick_gpus(book: ReplicaBook, nodes: Mapping[str, NodeView], now: float, plan: Plan) -> None:
    """A replica with a shard on a GPU its agent withholds as sick is replaced: the engine
    there cannot be trusted to serve, and the GPU will not be given out again."""
    for r in list(book.live()):
        for s in r.shards.values():
            node = nodes.get(s.node_id) if s.node_id else None
            if node is None or s.released or not node.inventory.sick_gpus:
                continue
            sick = {g.index: g.reason for g in node.inventory.sick_gpus}
            bad = [g for g in s.gpu_indices if g in sick]
            if bad:
                replace_lost(book, r, "; ".join(f"GPU {g} on {s.node_id} withheld as sick: {sick[g]}"
                                                for g in bad), now, plan)
                break
