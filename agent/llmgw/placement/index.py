"""Placement over a large fleet without scanning it: nodes indexed by what they can offer.

``place()`` asks every node and explains each answer; over 10,000 nodes that
is 10,000 group searches per replica.  But nodes with the same topology and
memory (one ``NodeShape``) and the same free GPUs offer exactly the same
best set, so the index keeps nodes in buckets keyed by (shape, free mask),
and, per kind of request (GPUs, per-GPU memory), the non-empty buckets in
order of preference.  A decision reads the first bucket(s) of that order and
takes the lowest node id there: the node and GPUs ``place()`` would choose
(the same preference: link score, then fit, then GPUs left over, then node
id), found in time independent of the fleet's size.

What it gives up: a result carries the verdict of the chosen node only, and
a refusal is one summary line counted per bucket; ``place()`` over
``nodes()`` still gives every node's reason (``llmgw ctl explain`` uses it).
Multi-node requests are placed by ``place()`` over the indexed nodes.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable

from llmgw.placement.group import NodeOption, choose_group, plural, schedulability
from llmgw.placement.memory import memory_need
from llmgw.placement.place import place, profile_problem
from llmgw.placement.shape import NodeShape, shape_of
from llmgw.placement.summary import replica_name
from llmgw.placement.types import NodeCapacity, NodeVerdict, Placement, PlacementRequest, PlacementResult, ShardPlan

BucketKey = tuple[int, int]  # (shape id, free mask)


class PlacementIndex:
    """A fleet's nodes, indexed for single-node placement (see the module docstring).

    Not thread-safe: one owner (the reconciler's pass) updates and asks it.
    """

    def __init__(self, nodes: Iterable[NodeCapacity] = ()):
        self._nodes: dict[str, NodeCapacity] = {}
        self._where: dict[str, BucketKey] = {}  # indexed (schedulable) nodes only
        self._buckets: dict[BucketKey, list[str]] = {}  # node ids, sorted
        self._shapes: dict[int, NodeShape] = {}
        self._unindexed: set[str] = set()  # nodes not schedulable
        # Distinct GPU memory sizes among indexed shapes: a per-GPU need is
        # only ever compared with these, so all needs between two sizes are
        # one kind of request.
        self._sizes: list[int] = []
        # (n, memory class) -> sorted [(preference, key)] of non-empty buckets that can host
        self._orders: dict[tuple[int, int | None], list[tuple[tuple, BucketKey]]] = {}
        for node in nodes:
            self.update(node)

    # --- the fleet -----------------------------------------------------------

    def __len__(self) -> int:
        return len(self._nodes)

    def nodes(self) -> list[NodeCapacity]:
        """Every node, in the order first added (what ``place()`` takes)."""
        return list(self._nodes.values())

    def node(self, node_id: str) -> NodeCapacity:
        return self._nodes[node_id]

    def update(self, node: NodeCapacity) -> None:
        """Add a node or replace what is known of it (free GPUs, schedulability, inventory)."""
        self._unindex(node.node_id)
        self._nodes[node.node_id] = node
        if schedulability(node) is not None:
            self._unindexed.add(node.node_id)
            return
        shape = shape_of(node.inventory)
        if id(shape) not in self._shapes:
            self._shapes[id(shape)] = shape
            sizes = sorted(set(self._sizes) | set(shape.memory))
            if sizes != self._sizes:
                self._sizes = sizes
                self._orders.clear()  # memory classes changed: orders are rebuilt when asked
        key = (id(shape), shape.mask_of(node.free_gpus))
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = []
        if not bucket:
            self._bucket_filled(key)
        bisect.insort(bucket, node.node_id)
        self._where[node.node_id] = key

    def remove(self, node_id: str) -> None:
        self._unindex(node_id)
        self._nodes.pop(node_id, None)

    def sync(self, nodes: Iterable[NodeCapacity]) -> int:
        """Make the index hold exactly ``nodes``, touching only what changed; returns how many changed.

        For a caller that rebuilds the fleet's capacities every pass (the
        reconciler's ``capacities()``) but wants to keep one index between
        passes: a node is re-bucketed only when its inventory object, free
        GPUs or schedulability differ from what the index holds.
        """
        seen: set[str] = set()
        changed = 0
        for node in nodes:
            seen.add(node.node_id)
            old = self._nodes.get(node.node_id)
            if (old is not None and old.inventory is node.inventory and old.free_gpus == node.free_gpus
                    and old.schedulable == node.schedulable and old.reason == node.reason):
                continue
            self.update(node)
            changed += 1
        for node_id in [n for n in self._nodes if n not in seen]:
            self.remove(node_id)
            changed += 1
        return changed

    def _memory_class(self, per_gpu: int | None) -> int | None:
        """The smallest GPU size in the fleet that holds ``per_gpu`` (a GPU holds
        the need exactly when it is at least that size); -1 when none does."""
        if per_gpu is None:
            return None
        i = bisect.bisect_left(self._sizes, per_gpu)
        return self._sizes[i] if i < len(self._sizes) else -1

    def take(self, placement: Placement) -> None:
        """Mark a placement's GPUs busy (after a replica is placed with them)."""
        for shard in placement.shards:
            node = self._nodes[shard.node_id]
            self.update(NodeCapacity(node.inventory, node.free_gpus - frozenset(shard.gpu_indices),
                                     node.schedulable, node.reason))

    def release(self, node_id: str, gpus: Iterable[int]) -> None:
        """Mark GPUs free again (a replica stopped)."""
        node = self._nodes[node_id]
        self.update(NodeCapacity(node.inventory, node.free_gpus | frozenset(gpus), node.schedulable, node.reason))

    # --- placing -------------------------------------------------------------

    def place(self, request: PlacementRequest) -> PlacementResult:
        """Where one replica would run (the node and GPUs ``place()`` would choose), or why not.

        Nothing is taken: call ``take(result.placement)`` once the replica is
        committed to it.  Verdicts: the chosen node's only.
        """
        if profile_problem(request) is not None or request.profile.nodes != 1:
            return place(request, self.nodes())
        n = request.profile.gpus_total
        need = memory_need(request)
        per_gpu = self._memory_class(need.per_gpu_bytes if need is not None else None)
        order = self._orders.get((n, per_gpu))
        if order is None:
            order = self._build_order(n, per_gpu)
        if not order:
            return self._refusal(request, n, per_gpu)
        pref = order[0][0]
        node_id = self._buckets[order[0][1]][0]
        for p, key in order[1:]:
            if p != pref:
                break
            node_id = min(node_id, self._buckets[key][0])
        option = choose_group(self._nodes[node_id], n, need)
        assert isinstance(option, NodeOption)
        placement = Placement(
            shards=(ShardPlan(node_id=node_id, rank=0, gpu_indices=option.gpus, env={}),),
            rule=option.rule, detail=option.describe())
        return PlacementResult(placement=placement, verdicts=(NodeVerdict(node_id, True, f"chosen: {option.describe()}"),))

    # --- buckets and orders ----------------------------------------------------

    def _unindex(self, node_id: str) -> None:
        self._unindexed.discard(node_id)
        key = self._where.pop(node_id, None)
        if key is None:
            return
        bucket = self._buckets[key]
        i = bisect.bisect_left(bucket, node_id)
        del bucket[i]
        if not bucket:
            for cls, order in self._orders.items():
                entry = self._entry(key, *cls)
                if entry is not None:
                    j = bisect.bisect_left(order, entry)
                    if j < len(order) and order[j] == entry:
                        del order[j]

    def _bucket_filled(self, key: BucketKey) -> None:
        for cls, order in self._orders.items():
            entry = self._entry(key, *cls)
            if entry is not None:
                bisect.insort(order, entry)

    def _entry(self, key: BucketKey, n: int, per_gpu: int | None) -> tuple[tuple, BucketKey] | None:
        if per_gpu == -1:
            return None
        shape = self._shapes[key[0]]
        mask = key[1]
        choice = shape.best(mask & shape.holding(per_gpu), n)
        if choice is None:
            return None
        return ((choice.score, choice.fit, mask.bit_count() - n), key)

    def _build_order(self, n: int, per_gpu: int | None) -> list[tuple[tuple, BucketKey]]:
        entries = [e for key, bucket in self._buckets.items() if bucket and (e := self._entry(key, n, per_gpu))]
        order = sorted(entries)
        self._orders[(n, per_gpu)] = order
        return order

    def _refusal(self, request: PlacementRequest, n: int, per_gpu: int | None) -> PlacementResult:
        """One line, counted per bucket: as ``place()`` summarises, without each node's words."""
        counts: Counter[str] = Counter()
        for (sid, mask), bucket in self._buckets.items():
            if not bucket:
                continue
            if mask.bit_count() < n:
                counts["too few free GPUs"] += len(bucket)
            elif self._shapes[sid].best(mask, n) is None:
                counts["too few GPUs of one model"] += len(bucket)
            else:
                counts["GPU memory too small"] += len(bucket)
        for node_id in self._unindexed:
            refused = schedulability(self._nodes[node_id])
            counts[refused.kind if refused else "not schedulable"] += 1
        head = f"no placement for {replica_name(request)} ({plural(n, 'GPU')} on one node)"
        if not counts:
            return PlacementResult(placement=None, reason=f"{head}: no nodes known")
        parts = ", ".join(f"{c} {k}" for k, c in sorted(counts.items(), key=lambda kc: (-kc[1], kc[0])))
        total = sum(counts.values())
        return PlacementResult(placement=None, reason=f"{head}: {plural(total, 'node')}: {parts}")
