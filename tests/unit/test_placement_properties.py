"""Properties of placement over random boxes and fleets, checked exhaustively.

The specification, written the slow way: on the chosen node, no other free
set of the same size whose GPUs each hold their share of the weights has a
better score (worst pair's tier, then the sum of all pairs' tiers); no node
offers a better-scored set than the chosen node's; a replica is placed
exactly when some node has enough such GPUs.  Boxes are small (up to 8
GPUs) so that every subset can be checked; the topology is drawn as a real
box is built (sockets, root complexes, PCIe switches, NVLink pairs or
islands), with some tiers unknown and some boxes without a matrix at all.
"""

from __future__ import annotations

from itertools import combinations

from hypothesis import given
from hypothesis import strategies as st
from placement_builders import request
from placement_strategies import SETTINGS, box, fleet, multi_request, single_request

from llmgw.hardware.topology import TIER_RANK, UNKNOWN_RANK
from llmgw.placement import NodeCapacity, PlacementRequest, place, place_many
from llmgw.placement.memory import memory_need


# --- the slow specification ----------------------------------------------------


def cost(c: NodeCapacity, a: int, b: int) -> int:
    """A pair's tier rank from the inventory alone (NVLink peers when no matrix)."""
    inv = c.inventory
    if inv.topology is not None:
        link = inv.topology.link(a, b)
        if link is not None and link.tier is not None:
            return TIER_RANK[link.tier]
    if inv.nvlink_known and (b in inv.gpu(a).nvlink_peers or a in inv.gpu(b).nvlink_peers):
        return 0
    return UNKNOWN_RANK


def score(c: NodeCapacity, group) -> tuple[int, int]:
    pairs = [cost(c, a, b) for a, b in combinations(group, 2)]
    return (max(pairs, default=0), sum(pairs))


def eligible(c: NodeCapacity, per_gpu: int | None) -> list[int]:
    mem = {g.index: g.memory_bytes for g in c.inventory.gpus}
    return sorted(i for i in c.free_gpus if i in mem and (per_gpu is None or mem[i] >= per_gpu))


def best_score(c: NodeCapacity, n: int, per_gpu: int | None):
    if not c.schedulable:
        return None
    return min((score(c, g) for g in combinations(eligible(c, per_gpu), n)), default=None)


def free_of(c: NodeCapacity) -> set[int]:
    return {i for i in c.free_gpus if i in {g.index for g in c.inventory.gpus}}


def check_invariants(result, req: PlacementRequest, nodes):
    by_id = {c.node_id: c for c in nodes}
    assert [v.node_id for v in result.verdicts] == [c.node_id for c in nodes]
    if result.placement is None:
        assert result.reason
        assert all(not v.ok for v in result.verdicts)
        return
    p = req.profile
    shards = result.placement.shards
    assert len(shards) == p.nodes
    assert len({s.node_id for s in shards}) == p.nodes
    assert [s.rank for s in shards] == list(range(p.nodes))
    need = memory_need(req)
    for s in shards:
        assert len(s.gpu_indices) == p.gpus_per_node
        assert list(s.gpu_indices) == sorted(set(s.gpu_indices))
        assert set(s.gpu_indices) <= free_of(by_id[s.node_id])
        assert by_id[s.node_id].schedulable
        if need is not None:  # each GPU holds its share, never a group total
            assert all(by_id[s.node_id].inventory.gpu(g).memory_bytes >= need.per_gpu_bytes for g in s.gpu_indices)
        # never scored worse than any other free set of the same size on that node
        c = by_id[s.node_id]
        per_gpu = None if need is None else need.per_gpu_bytes
        assert score(c, s.gpu_indices) == best_score(c, len(s.gpu_indices), per_gpu)
    chosen = {s.node_id for s in shards}
    assert all(v.ok for v in result.verdicts if v.node_id in chosen)


# --- single node -----------------------------------------------------------------


@SETTINGS
@given(nodes=fleet(4, 8), req=single_request())
def test_single_node_never_scores_worse_than_any_free_set(nodes, req):
    result = place(req, nodes)
    check_invariants(result, req, nodes)
    assert place(req, nodes) == result  # deterministic
    n = req.profile.gpus_total
    need = memory_need(req)
    per_gpu = None if need is None else need.per_gpu_bytes
    options = {c.node_id: s for c in nodes if (s := best_score(c, n, per_gpu)) is not None}
    if not options:
        assert result.placement is None
        return
    (shard,) = result.placement.shards
    # no node offers a better-scored set than the chosen one
    assert options[shard.node_id] == min(options.values())
    assert {v.node_id for v in result.verdicts if v.ok} == set(options)


@SETTINGS
@given(c=box("gpu-a", 8), n=st.integers(1, 8))
def test_best_fit_never_splits_an_island_it_could_keep(c, n):
    """Among the sets scored best, the one chosen splits no more free NVLink
    islands than any other (a TP=1 replica takes a GPU whose partner is busy)."""
    result = place(request(tp=n), [c])
    if result.placement is None:
        return
    (shard,) = result.placement.shards
    free = eligible(c, None)
    islands = []
    seen: set[int] = set()
    for g in free:  # components of the NVLink graph among free GPUs
        if g in seen:
            continue
        comp, todo = {g}, [g]
        while todo:
            x = todo.pop()
            for y in free:
                if y not in comp and cost(c, x, y) == 0:
                    comp.add(y)
                    todo.append(y)
        seen |= comp
        islands.append(comp)

    def splits(group) -> int:
        return sum(1 for i in islands if i & set(group) and i - set(group))

    best = score(c, shard.gpu_indices)
    same = [g for g in combinations(free, n) if score(c, g) == best]
    assert splits(shard.gpu_indices) == min(splits(g) for g in same)


# --- multi node ------------------------------------------------------------------


def _rate_key(r):
    return -1.0 if r is None else r


@SETTINGS
@given(nodes=fleet(6, 8, ("ib-a", "ib-b"), min_nodes=2), req=multi_request())
def test_multi_node_takes_the_fastest_fabric_and_best_sets(nodes, req):
    result = place(req, nodes)
    check_invariants(result, req, nodes)
    k, gpn = req.profile.nodes, req.profile.gpus_per_node
    need = memory_need(req)
    per_gpu = None if need is None else need.per_gpu_bytes
    options = {c.node_id for c in nodes if best_score(c, gpn, per_gpu) is not None}
    eligible_by: dict[str, list[tuple[str, float | None]]] = {}
    for c in nodes:
        if c.node_id in options:
            for f in c.inventory.fabrics:
                if f.usable:
                    eligible_by.setdefault(f.name, []).append((c.node_id, f.rate_gbps))
    feasible = {name: ms for name, ms in eligible_by.items() if len(ms) >= k}
    if not feasible:
        assert result.placement is None
        return
    p = result.placement
    assert p is not None and p.rule == "multi-node"
    best_rate = max(sorted((_rate_key(r) for _, r in ms), reverse=True)[k - 1] for ms in feasible.values())
    by_id = {c.node_id: c for c in nodes}
    statuses = [by_id[s.node_id].inventory.fabric(p.fabric) for s in p.shards]
    assert all(f is not None and f.usable for f in statuses)
    assert min(_rate_key(f.rate_gbps) for f in statuses) == best_rate
    rates = [f.rate_gbps for f in statuses]
    assert p.fabric_rate_gbps == (None if None in rates else min(rates))
    for s, f in zip(p.shards, statuses):
        assert s.env["NCCL_IB_HCA"] == "=" + ",".join(f.advertised_hcas)


# --- many replicas ---------------------------------------------------------------


@SETTINGS
@given(
    nodes=fleet(4, 8, ("ib-a",)),
    reqs=st.lists(st.one_of(single_request(), multi_request()), min_size=1, max_size=6),
)
def test_place_many_never_hands_out_a_gpu_twice(nodes, reqs):
    results = place_many(reqs, nodes)
    assert len(results) == len(reqs)
    taken: dict[str, set[int]] = {}
    for req, result in zip(reqs, results):
        if result.placement is None:
            continue
        for s in result.placement.shards:
            used = taken.setdefault(s.node_id, set())
            assert not used & set(s.gpu_indices)
            used |= set(s.gpu_indices)
    for c in nodes:
        assert taken.get(c.node_id, set()) <= free_of(c)
