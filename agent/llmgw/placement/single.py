"""Single-node placement: one tensor-parallel group on one node.

Among the nodes that can host the group, prefer the best-scored set (its
worst link, then all its links: a group straddling PCIe or sockets runs
several times slower and nothing else would say so), then best fit (the
set that splits the fewest free islands, then the node it fills most), so
that large free blocks stay whole for large groups; node id breaks ties.
This scans every node and explains each; ``llmgw.placement.index`` reaches
the same choice without the scan.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmgw.placement.group import NodeOption, Refusal, choose_group, plural
from llmgw.placement.memory import memory_need
from llmgw.placement.summary import summarise
from llmgw.placement.types import (
    NodeCapacity,
    NodeVerdict,
    Placement,
    PlacementRequest,
    PlacementResult,
    ShardPlan,
)


def _preference(o: NodeOption) -> tuple:
    return o.preference


def _why_not_chosen(o: NodeOption, best: NodeOption) -> str:
    if best.nvlink and not o.nvlink:
        return f"{best.node_id} offers an NVLink-connected set"
    if best.choice.score != o.choice.score:
        return f"{best.node_id} offers closer links ({best.why})"
    if best.choice.fit != o.choice.fit:
        return f"{best.node_id} fits better (splits fewer free islands)"
    if o.stranded != best.stranded:
        return (
            f"{best.node_id} fits better (leaves {plural(best.stranded, 'free GPU')}, this node {o.stranded})"
        )
    return f"{best.node_id} fits as well and comes first by node id"


def place_single(request: PlacementRequest, nodes: Sequence[NodeCapacity]) -> PlacementResult:
    n = request.profile.gpus_total
    need = memory_need(request)
    answers: list[NodeOption | Refusal] = [choose_group(node, n, need) for node in nodes]
    options = [a for a in answers if isinstance(a, NodeOption)]
    if not options:
        refusals = [a for a in answers if isinstance(a, Refusal)]
        return PlacementResult(
            placement=None,
            verdicts=tuple(NodeVerdict(r.node_id, False, r.text) for r in refusals),
            reason=summarise(request, f"{plural(n, 'GPU')} on one node", refusals),
        )
    best = min(options, key=_preference)
    verdicts = []
    for a in answers:
        if isinstance(a, Refusal):
            verdicts.append(NodeVerdict(a.node_id, False, a.text))
        elif a is best:
            verdicts.append(NodeVerdict(a.node_id, True, f"chosen: {a.describe()}"))
        else:
            verdicts.append(
                NodeVerdict(
                    a.node_id,
                    True,
                    f"fits ({a.describe(memory=False)}), not chosen: {_why_not_chosen(a, best)}",
                )
            )
    placement = Placement(
        shards=(ShardPlan(node_id=best.node_id, rank=0, gpu_indices=best.gpus, env={}),),
        rule=best.rule,
        detail=best.describe(),
    )
    return PlacementResult(placement=placement, verdicts=tuple(verdicts))
