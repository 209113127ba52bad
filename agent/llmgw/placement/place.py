"""Entry points: place one replica, or each declared replica in turn."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace

from llmgw.placement.multi import place_multi
from llmgw.placement.single import place_single
from llmgw.placement.summary import replica_name
from llmgw.placement.types import NodeCapacity, NodeVerdict, PlacementRequest, PlacementResult


def profile_problem(request: PlacementRequest) -> str | None:
    """Why the profile's shape cannot be placed on any fleet, if it cannot."""
    p = request.profile
    for field in ("tensor_parallel_size", "pipeline_parallel_size", "nodes"):
        value = getattr(p, field)
        if value < 1:
            return f"profile {p.name}: {field} must be at least 1, got {value}"
    if p.gpus_total % p.nodes:
        return (
            f"profile {p.name}: {p.gpus_total} GPUs (tensor_parallel_size {p.tensor_parallel_size} x "
            f"pipeline_parallel_size {p.pipeline_parallel_size}) do not split evenly across {p.nodes} nodes"
        )
    return None


def _distinct(nodes: Sequence[NodeCapacity]) -> list[NodeCapacity]:
    # A node listed twice must not be handed out twice.
    seen: set[str] = set()
    out = []
    for n in nodes:
        if n.node_id not in seen:
            seen.add(n.node_id)
            out.append(n)
    return out


def place(request: PlacementRequest, nodes: Sequence[NodeCapacity]) -> PlacementResult:
    """Where one replica of ``request`` would run, or every node's reason why not."""
    nodes = _distinct(nodes)
    problem = profile_problem(request)
    if problem is not None:
        return PlacementResult(
            placement=None,
            verdicts=tuple(NodeVerdict(n.node_id, False, problem) for n in nodes),
            reason=f"no placement for {replica_name(request)}: {problem}",
        )
    if request.profile.nodes == 1:
        return place_single(request, nodes)
    return place_multi(request, nodes)


def place_many(requests: Sequence[PlacementRequest], nodes: Sequence[NodeCapacity],
               placed: Mapping[tuple[str, str], Collection[str]] | None = None) -> list[PlacementResult]:
    """Place ``requests`` in order, each on what the earlier ones left free.

    Greedy on purpose: it is what the reconciler does replica by replica, so
    ``ctl explain`` shows the same answer the reconciler will reach.
    ``placed`` says where replicas already run, by (model, profile): a
    replica of a prefill/decode group goes where its peers (those and the
    ones placed earlier in this call) can reach it (``placement.roles``).
    """
    from llmgw.placement.roles import place_paired  # it places through ``place``

    current = {n.node_id: n for n in _distinct(nodes)}
    where: dict[tuple[str, str], set[str]] = {k: set(v) for k, v in (placed or {}).items()}
    results = []
    for request in requests:
        result = place_paired(request, list(current.values()), where)
        results.append(result)
        if result.placement is not None:
            where.setdefault((request.model.name, request.profile.name), set()).update(result.placement.nodes)
            for shard in result.placement.shards:
                node = current[shard.node_id]
                current[shard.node_id] = replace(
                    node, free_gpus=node.free_gpus - frozenset(shard.gpu_indices)
                )
    return results


__all__ = ["place", "place_many", "profile_problem"]
