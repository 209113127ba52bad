"""NVLink topology on one node: the peer graph and the search for a fully
connected group of GPUs.

A tensor-parallel group all-reduces on every layer, so one pair of GPUs that
talks over PCIe instead of NVLink slows the whole group down.  The group we
want is therefore a clique of the NVLink graph, and among cliques the one
with the lowest indices, so that the same inventory always gives the same
answer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from llmgw.hardware.types import HardwareInventory

# A bound on search nodes, far above what 16 GPUs can need (2**16 subsets):
# only an adversarial graph on a much larger node could reach it, and then
# we would rather fall back to the lowest free indices than stall the
# control plane.
DEFAULT_MAX_STEPS = 200_000


def peer_graph(inventory: HardwareInventory) -> dict[int, frozenset[int]]:
    """Symmetric NVLink adjacency between the node's GPUs.

    NVML reports links per GPU, and a link seen from one end only (a
    half-read topology, a simulated file written by hand) still joins both
    ends.  Self-links and peers that are not GPUs of this node are ignored.
    """
    indices = {g.index for g in inventory.gpus}
    adj: dict[int, set[int]] = {i: set() for i in indices}
    for g in inventory.gpus:
        for p in g.nvlink_peers:
            if p != g.index and p in indices:
                adj[g.index].add(p)
                adj[p].add(g.index)
    return {i: frozenset(peers) for i, peers in adj.items()}


@dataclass(frozen=True)
class CliqueSearch:
    group: tuple[int, ...] | None  # the lowest fully connected group, if any
    exhausted: bool  # True when the step budget ran out before an answer
    steps: int


def _popcount(x: int) -> int:
    return x.bit_count()


def _colour_bound(p: int, adj: Sequence[int]) -> int:
    """Colours a greedy colouring of ``p`` needs: an upper bound on its
    largest clique, since a clique's members all need different colours."""
    colours = 0
    uncoloured = p
    while uncoloured:
        colours += 1
        avail = uncoloured
        while avail:
            v = avail & -avail
            uncoloured &= ~v
            avail &= ~v & ~adj[v.bit_length() - 1]
    return colours


def lowest_clique(
    candidates: Iterable[int],
    size: int,
    adj: Mapping[int, Iterable[int]],
    accept: Callable[[tuple[int, ...]], bool] | None = None,
    max_steps: int = DEFAULT_MAX_STEPS,
) -> CliqueSearch:
    """Find the lexicographically lowest ``size``-clique among ``candidates``
    that ``accept`` (when given) agrees to.

    Backtracking in ascending order finds the lowest clique first; branches
    that cannot reach ``size`` (too few candidates left, or more than a
    greedy colouring allows) are cut, which keeps a 16-GPU node fast even
    when no clique exists.
    """
    if size < 1:
        raise ValueError(f"clique size must be at least 1, got {size}")
    order = sorted(set(candidates))
    pos = {gpu: i for i, gpu in enumerate(order)}
    masks = [0] * len(order)
    for gpu, i in pos.items():
        for peer in adj.get(gpu, ()):
            j = pos.get(peer)
            if j is not None and j != i:
                masks[i] |= 1 << j
                masks[j] |= 1 << i
    steps = 0
    exhausted = False

    def search(chosen: list[int], p: int) -> tuple[int, ...] | None:
        nonlocal steps, exhausted
        need = size - len(chosen)
        if need == 0:
            group = tuple(order[i] for i in chosen)
            return group if accept is None or accept(group) else None
        while p and _popcount(p) >= need:
            if steps >= max_steps:
                exhausted = True
                return None
            steps += 1
            if _colour_bound(p, masks) < need:
                return None
            v = p & -p
            i = v.bit_length() - 1
            p &= ~v
            # Only higher positions follow, so each clique is visited once
            # and in ascending order.
            found = search(chosen + [i], p & masks[i])
            if found is not None or exhausted:
                return found
        return None

    group = search([], (1 << len(order)) - 1)
    return CliqueSearch(group=group, exhausted=exhausted, steps=steps)
