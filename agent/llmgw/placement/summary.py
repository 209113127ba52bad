"""The one-line reason when nothing fits; the node-by-node detail is in the verdicts."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from llmgw.placement.group import Refusal, plural
from llmgw.placement.types import PlacementRequest


def replica_name(request: PlacementRequest) -> str:
    return f"{request.model.name}/{request.profile.name}"


def summarise(request: PlacementRequest, needs: str, refusals: Sequence[Refusal]) -> str:
    """ "no placement for m/p (4 GPUs on one node): 3 nodes: 2 too few free GPUs, 1 unreachable"."""
    head = f"no placement for {replica_name(request)} ({needs})"
    if not refusals:
        return f"{head}: no nodes known"
    counts = Counter(r.kind for r in refusals)
    # Most common first; kinds in order of first appearance break ties.
    order = {k: i for i, k in reversed(list(enumerate(r.kind for r in refusals)))}
    parts = [f"{c} {k}" for k, c in sorted(counts.items(), key=lambda kc: (-kc[1], order[kc[0]]))]
    return f"{head}: {plural(len(refusals), 'node')}: {', '.join(parts)}"
