"""One node's GPUs as placement sees them: the cost of every pair's link, and
the best free set of each size, scored and memoised.

A set of GPUs is scored by its links: first its worst pair (a tensor-parallel
all-reduce runs at the pace of its slowest link), then the sum over all pairs
(so that a group larger than one NVLink island takes whole islands, the
fewest, joined by the closest tier), then the NVLinks it has (NV18 beats
NV4).  Among sets scored the same, best fit: the one that breaks the fewest
free islands, NVLink islands first, then PCIe switches, host bridges, NUMA
nodes, so that a TP=1 replica takes a GPU whose partner is already busy
rather than split an intact pair a larger group needs next.  Lowest indices
break what ties remain, so the same inputs always give the same answer.

A set is always one GPU model: a tensor-parallel group runs at the pace of
its slowest card and splits memory evenly, so an H100 beside an L40S gives
the H100's speed and memory away (and mixed architectures may not run the
same kernels at all).  A box of 4 H100 and 4 L40S offers H100 sets and L40S
sets, never one of each.

The search is exhaustive over the free GPUs (70 sets for 4 of 8), which is
cheap only because it is memoised: a ``NodeShape`` is shared by every node
with the same topology, memory and models (``shape_of``), and remembers its
answer per (free mask, size, adapter distances).  The memos never change an
answer (everything here is a function of its inputs); they are held weakly,
so what no inventory or index uses any more is let go.  ``node_key`` is the
whole of what placement sees of a node: the control plane's capacity classes
and the placement index's buckets are both drawn from it.  A fleet of 10,000 identical
8-GPU nodes thus searches at most 256 masks x 8 sizes, once.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from llmgw.hardware.topology import TIER_WORDS, TIERS, UNKNOWN_RANK, label, pci_tier, rank
from llmgw.hardware.types import HardwareInventory

NV = 0
# Island levels for best fit: components of links at most this tier (NV .. NODE).
FIT_LEVELS = tuple(range(TIERS.index("NODE") + 1))
# Above this many candidate sets the search is greedy (only a node with far more
# GPUs than any board has today gets there: C(16, 8) = 12870).
MAX_EXHAUSTIVE = 20_000

# "no free set of 4 <within ...>": what a set must stay within to be better than the tier after it.
WITHIN = {
    "NV": "fully connected by NVLink",
    "PIX": "behind one PCIe switch",
    "PXB": "within one PCIe switch tree",
    "PHB": "behind one host bridge",
    "NODE": "within one NUMA node",
    "SYS": "with every link known",
}


@dataclass(frozen=True)
class Choice:
    """The best free set of one size, with what made it best."""

    positions: tuple[int, ...]  # positions in the shape (not GPU indices)
    gpus: tuple[int, ...]
    worst: int  # tier rank of the worst pair; 0 (NV) for one GPU
    total: int  # sum of pair ranks
    nvlinks: int  # NVLinks among its pairs
    near: int  # sum of each GPU's tier rank to the nearest given adapter (0 when none given)
    broken: tuple[int, ...]  # free islands it splits, per FIT_LEVELS
    # The lowest-index set scored the same, when best fit chose another (for the words).
    passed_over: tuple[int, ...] | None = None
    passed_over_broken: tuple[int, ...] | None = None

    @property
    def score(self) -> tuple[int, int, int, int]:
        """Lower is better: worst pair, sum, more NVLinks, closer to the adapters."""
        return (self.worst, self.total, -self.nvlinks, self.near)

    @property
    def fit(self) -> tuple[int, ...]:
        return self.broken

    @property
    def key(self) -> tuple:
        return (self.score, self.broken, self.gpus)


def _components(positions: Sequence[int], adj: Sequence[int], mask: int) -> list[int]:
    """Connected components (as bit masks) of ``mask`` under adjacency masks ``adj``."""
    seen = 0
    out = []
    for p in positions:
        bit = 1 << p
        if not mask & bit or seen & bit:
            continue
        comp = bit
        frontier = bit
        while frontier:
            v = frontier & -frontier
            frontier &= ~v
            new = adj[v.bit_length() - 1] & mask & ~comp
            comp |= new
            frontier |= new
        seen |= comp
        out.append(comp)
    return out


class NodeShape:
    """The link costs between a node's GPUs, its memory, and memoised best sets."""

    def __init__(self, indices: tuple[int, ...], cost: tuple[tuple[int, ...], ...],
                 nvlinks: tuple[tuple[int, ...], ...], memory: tuple[int, ...], known: bool,
                 models: tuple[str, ...] | None = None):
        # Equal shapes are equal by what they are, not by being the one shared
        # object: a memo that forgot one must not split a class of nodes.
        self.signature = (indices, cost, nvlinks, memory, models)
        self._hash = hash(self.signature)
        self.indices = indices
        self.pos = {g: i for i, g in enumerate(indices)}
        self.size = len(indices)
        self.cost = cost
        self.nvl = nvlinks
        self.memory = memory
        self.known = known  # every pair's tier known
        # GPU model per position; a set is only ever drawn from one model's GPUs.
        self.models = models if models is not None else ("",) * len(indices)
        names = tuple(dict.fromkeys(self.models))
        self.model_names = names
        self.model_masks = tuple(sum(1 << p for p, m in enumerate(self.models) if m == name) for name in names)
        self.all_mask = (1 << self.size) - 1
        # adjacency per level: GPUs joined by links at most that tier
        self.level_adj = tuple(
            tuple(sum(1 << j for j in range(self.size) if j != i and cost[i][j] <= lvl) for i in range(self.size))
            for lvl in FIT_LEVELS
        )
        self.present = frozenset(cost[i][j] for i in range(self.size) for j in range(self.size) if i != j)
        self._best: dict[tuple[int, int, tuple[int, ...] | None], Choice | None] = {}
        self._mem_ok: dict[int, int] = {}
        self._lock = threading.Lock()

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, NodeShape) and self._hash == other._hash
                                 and self.signature == other.signature)

    def __hash__(self) -> int:
        return self._hash

    # --- masks ---------------------------------------------------------------

    def mask_of(self, gpus) -> int:
        m = 0
        pos = self.pos
        for g in gpus:
            p = pos.get(g)
            if p is not None:
                m |= 1 << p
        return m

    def model_mask(self, model: str) -> int:
        """Mask of this node's GPUs of ``model`` (0 when it has none)."""
        try:
            return self.model_masks[self.model_names.index(model)]
        except ValueError:
            return 0

    def gpus_of(self, mask: int) -> tuple[int, ...]:
        return tuple(self.indices[p] for p in range(self.size) if mask >> p & 1)

    def holding(self, per_gpu: int | None) -> int:
        """Mask of GPUs with at least ``per_gpu`` bytes (all when None)."""
        if per_gpu is None:
            return self.all_mask
        m = self._mem_ok.get(per_gpu)
        if m is None:
            m = sum(1 << p for p, mem in enumerate(self.memory) if mem >= per_gpu)
            self._mem_ok[per_gpu] = m
        return m

    # --- the search ----------------------------------------------------------

    def best(self, mask: int, n: int, near: tuple[int, ...] | None = None) -> Choice | None:
        """The best set of ``n`` GPUs within ``mask``, or None if too few;
        ``near`` is each position's tier rank to the closest adapter."""
        key = (mask, n, near)
        found = self._best.get(key, False)
        if found is not False:
            return found  # type: ignore[return-value]
        choice = self._search(mask, n, near)
        with self._lock:
            self._best[key] = choice
        return choice

    def _search(self, mask: int, n: int, near: tuple[int, ...] | None) -> Choice | None:
        free = [p for p in range(self.size) if mask >> p & 1]
        if n < 1 or len(free) < n:
            return None
        islands = [_components(free, adj, mask) for adj in self.level_adj]
        candidates = itertools.chain.from_iterable(
            itertools.combinations(same, n) if math.comb(len(same), n) <= MAX_EXHAUSTIVE
            else iter([self._greedy(same, n)])
            for same in ([p for p in free if mm >> p & 1] for mm in self.model_masks) if len(same) >= n)
        best: Choice | None = None
        best_key = None
        first: tuple[tuple, tuple[int, ...], tuple[int, ...]] | None = None  # (score, combo, broken) of the lowest best-scored
        cost, nvl = self.cost, self.nvl
        for combo in candidates:
            worst = total = links = 0
            for i, a in enumerate(combo):
                row, lrow = cost[a], nvl[a]
                for b in combo[i + 1:]:
                    c = row[b]
                    total += c
                    if c > worst:
                        worst = c
                    links += lrow[b]
            close = 0 if near is None else sum(near[p] for p in combo)
            score = (worst, total, -links, close)
            if best_key is not None and score > best_key[0]:
                continue
            cmask = sum(1 << p for p in combo)
            broken = tuple(sum(1 for comp in level if comp & cmask and comp & ~cmask) for level in islands)
            k = (score, broken, combo)  # lowest indices win ties (models' GPUs come one model after another)
            if first is None or (score, combo) < first[:2]:
                first = (score, combo, broken)
            if best_key is None or k < best_key:
                best_key = k
                best = Choice(positions=combo, gpus=tuple(self.indices[p] for p in combo), worst=worst,
                              total=total, nvlinks=links, near=close, broken=broken)
        if best is not None and first is not None and first[1] != best.positions:
            best = dataclasses.replace(best, passed_over=tuple(self.indices[p] for p in first[1]),
                                       passed_over_broken=first[2])
        return best

    def _greedy(self, free: list[int], n: int) -> tuple[int, ...]:
        """Grow from the best pair, adding the GPU whose worst and summed link
        to the set is least (for nodes too large to search exhaustively)."""
        cost = self.cost
        a, b = min(itertools.combinations(free, 2), key=lambda ab: (cost[ab[0]][ab[1]], ab))
        chosen = [a, b]
        rest = [p for p in free if p not in chosen]
        while len(chosen) < n:
            p = min(rest, key=lambda q: (max(cost[q][c] for c in chosen), sum(cost[q][c] for c in chosen), q))
            chosen.append(p)
            rest.remove(p)
        return tuple(sorted(chosen))

    # --- words ---------------------------------------------------------------

    def tiers_text(self, choice: Choice) -> str:
        """Which links the set uses: "fully connected by NVLink (NV4)",
        "2 NVLink islands (4,5 | 6,7) joined by NODE (host bridges within one NUMA node)"."""
        pos = choice.positions
        if len(pos) == 1:
            return ""
        if choice.worst == NV:
            links = min(self.nvl[a][b] for a, b in itertools.combinations(pos, 2))
            return f"fully connected by NVLink ({label('NV', links)})" if links else "fully connected by NVLink"
        cmask = sum(1 << p for p in pos)
        nv_islands = [c for c in _components(pos, self.level_adj[NV], cmask) if c & (c - 1)]
        worst = None if choice.worst >= UNKNOWN_RANK else TIERS[choice.worst]
        joined = f"{label(worst)} ({TIER_WORDS[worst]})" if worst else "links of unknown tier"
        if nv_islands:
            groups = " | ".join(",".join(str(g) for g in self.gpus_of(c)) for c in nv_islands)
            n = len(nv_islands)
            what = "NVLink island" if n == 1 else "NVLink islands"
            return f"{n} {what} ({groups}) joined by {joined}"
        if worst is None:
            return "lowest free indices"
        return f"joined by {joined}"

    def given_up(self, choice: Choice) -> str | None:
        """What no free set of this size offered: the tier just better than the one used."""
        if len(choice.positions) < 2 or choice.worst == NV or choice.worst >= UNKNOWN_RANK:
            return None
        # The next better tier this node has at all: "behind one PCIe switch" on a box
        # whose switches hang off one host bridge, not "within one switch tree".
        better = [t for t in self.present if t < choice.worst]
        if not better:
            return None
        return f"no free set of {len(choice.positions)} {WITHIN[TIERS[max(better)]]}"

    def fit_text(self, choice: Choice) -> str | None:
        """Why not the lowest free indices scored as well: the island they would split."""
        if choice.passed_over is None or choice.passed_over_broken is None:
            return None
        for level, (mine, theirs) in enumerate(zip(choice.broken, choice.passed_over_broken)):
            if theirs > mine:
                return f"best fit: {_gpus(choice.passed_over)} would split {SPLIT[level]}"
        return None


SPLIT = ("a free NVLink island", "a free PCIe switch's GPUs", "a free PCIe switch tree",
         "a free host bridge's GPUs", "a free NUMA node's GPUs")


def _gpus(gpus: Sequence[int]) -> str:
    return f"{'GPU' if len(gpus) == 1 else 'GPUs'} {','.join(str(g) for g in gpus)}"


def adapter_ranks(shape: NodeShape, inventory: HardwareInventory, adapters: Sequence[str]) -> tuple[int, ...] | None:
    """Each GPU's tier rank to the closest of ``adapters`` (by PCI path and
    NUMA node); None when no adapter's place is known."""
    names = {a.split(":", 1)[0] for a in adapters}
    hcas = [h for h in inventory.hcas if h.name in names and h.pci_path]
    if not hcas:
        return None
    by_index = {g.index: g for g in inventory.gpus}
    out = []
    for idx in shape.indices:
        g = by_index[idx]
        out.append(min(rank(pci_tier(g.pci_path, g.numa_node, h.pci_path, h.numa_node)) for h in hcas))
    return tuple(out)


def _signature(inv: HardwareInventory) -> tuple:
    gpus = sorted(inv.gpus, key=lambda g: g.index)
    indices = tuple(g.index for g in gpus)
    links = inv.topology.as_map() if inv.topology is not None else {}
    peers = {g.index: set(g.nvlink_peers) for g in gpus}
    cost = []
    nvl = []
    for a in indices:
        crow, nrow = [], []
        for b in indices:
            if a == b:
                crow.append(0)
                nrow.append(0)
                continue
            link = links.get((min(a, b), max(a, b)))
            if link is not None and link.tier is not None:
                crow.append(rank(link.tier))
                nrow.append(link.nvlinks if link.tier == "NV" else 0)
            elif inv.nvlink_known and (b in peers[a] or a in peers[b]):
                crow.append(NV)
                nrow.append(link.nvlinks if link is not None else 0)
            else:
                crow.append(UNKNOWN_RANK)
                nrow.append(0)
        cost.append(tuple(crow))
        nvl.append(tuple(nrow))
    memory = tuple(g.memory_bytes for g in gpus)
    models = tuple(g.name for g in gpus)
    return (indices, tuple(cost), tuple(nvl), memory, models)


# Memos of pure functions (an answer never depends on them): one NodeShape per
# distinct signature while some inventory or index still uses it, so a fleet
# of identical boxes shares one search; and each live inventory's shape, so a
# decision does not recompute the signature.  Both let go of what nobody holds.
_shapes: "weakref.WeakValueDictionary[tuple, NodeShape]" = weakref.WeakValueDictionary()
_by_inventory: dict[int, tuple[weakref.ref[HardwareInventory], NodeShape]] = {}
_shapes_lock = threading.Lock()
_MAX_INVENTORIES = 200_000


def shape_of(inv: HardwareInventory) -> NodeShape:
    """The shape of this inventory's GPUs (one per distinct topology, memory and models).

    Remembered per inventory object to spare recomputing the signature on
    every decision.  The entry goes when the inventory does: a control plane
    sees a new inventory at every registration, and holding the old ones
    would keep every storm's worth of them in memory.
    """
    hit = _by_inventory.get(id(inv))
    if hit is not None and hit[0]() is inv:
        return hit[1]
    sig = _signature(inv)
    with _shapes_lock:
        shape = _shapes.get(sig)
        if shape is None:
            indices, cost, nvl, memory, models = sig
            known = all(c < UNKNOWN_RANK for row in cost for c in row)
            shape = NodeShape(indices, cost, nvl, memory, known, models)
            _shapes[sig] = shape
        if len(_by_inventory) >= _MAX_INVENTORIES:
            _by_inventory.clear()
        key = id(inv)
        _by_inventory[key] = (weakref.ref(inv, lambda _ref, key=key: _forget(key, _ref)), shape)
    return shape


def _forget(key: int, ref: weakref.ref) -> None:
    hit = _by_inventory.get(key)
    if hit is not None and hit[0] is ref:
        del _by_inventory[key]


def node_key(inv: HardwareInventory) -> tuple[NodeShape, str]:
    """Everything placement can see of a node, without its identities: the one node-shape notion.

    Its GPUs' shape (``shape_of``: links, memory, models), then where its
    GPUs and adapters sit and its fabrics (a multi-node rank's adapter
    distance and fabric choice read these).  Node id, GPU UUIDs and PCI
    addresses never change an answer, so two nodes with one key and the same
    free GPUs are interchangeable: the control plane's capacity classes are
    keyed by it, and the placement index buckets by its first part.
    """
    places = (tuple((g.index, g.numa_node, g.pci_path) for g in sorted(inv.gpus, key=lambda g: g.index)),
              tuple((h.name, h.numa_node, h.pci_path) for h in inv.hcas),
              tuple(sorted(repr(sorted(f.to_dict().items())) for f in inv.fabrics)))
    return shape_of(inv), sys.intern(repr(places))  # one string per distinct layout, not one per node
