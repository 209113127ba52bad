"""Placement results as text for `llmgw ctl explain`."""

from __future__ import annotations

from llmgw.placement.summary import replica_name
from llmgw.placement.types import PlacementRequest, PlacementResult


def format_result(result: PlacementResult, request: PlacementRequest) -> str:
    """One line for the placement (or why there is none), then one per node."""
    name = replica_name(request)
    if result.placement is not None:
        p = result.placement
        head = f"{name}: placed ({p.rule}): {p.detail}"
    else:
        reason = result.reason or "no placement"
        head = reason if reason.startswith("no placement for") else f"{name}: {reason}"
    lines = [head]
    width = max((len(v.node_id) for v in result.verdicts), default=0)
    for v in result.verdicts:
        mark = "ok" if v.ok else "no"
        lines.append(f"  {v.node_id:<{width}}  {mark}  {v.reason}")
    return "\n".join(lines)
