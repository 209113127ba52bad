"""Properties of placement over random fleets, checked against brute force.

Brute force is the specification written the slow way: every combination of
free GPUs in index order, the first fully NVLink-connected one that holds the
weights, else the first that holds them; then the node preference
(NVLink, fewest stranded, node id).  It is run on nodes of up to 12 GPUs;
larger nodes (up to 16) are checked for the invariants alone.
"""

from __future__ import annotations

import random
from itertools import combinations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_placement_builders import GIB, cap, inventory, request

from llmgw.hardware.types import FabricStatus
from llmgw.placement import NodeCapacity, PlacementRequest, place, place_many
from llmgw.placement.memory import memory_need
from llmgw.placement.nvlink import peer_graph

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- strategies ----------------------------------------------------------------


@st.composite
def nvlink_graph(draw, n: int) -> dict[int, set[int]]:
    """Peer lists as NVML might report them: random, blocks (NVSwitch islands,
    PCIe bridges), full or empty, each link seen from one end or both."""
    kind = draw(st.sampled_from(["random", "blocks", "full", "none"]))
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    if kind == "random":
        density = draw(st.sampled_from([0.2, 0.5, 0.8, 0.95]))
        edges = [p for p in pairs if rng.random() < density]
    elif kind == "blocks":
        size = draw(st.integers(1, max(1, n)))
        edges = [(i, j) for i, j in pairs if i // size == j // size]
    elif kind == "full":
        edges = pairs
    else:
        edges = []
    peers: dict[int, set[int]] = {i: set() for i in range(n)}
    for i, j in edges:
        side = rng.choice(("lo", "hi", "both"))
        if side in ("lo", "both"):
            peers[i].add(j)
        if side in ("hi", "both"):
            peers[j].add(i)
    return peers


@st.composite
def node(draw, node_id: str, max_gpus: int, fabric_names=()) -> NodeCapacity:
    n = draw(st.integers(1, max_gpus))
    peers = draw(nvlink_graph(n))
    uniform = draw(st.booleans())
    sizes = (
        [draw(st.sampled_from([24, 48, 80]))] * n
        if uniform
        else draw(st.lists(st.sampled_from([24, 48, 80]), min_size=n, max_size=n))
    )
    fabrics = []
    for name in fabric_names:
        if draw(st.integers(0, 3)) > 0:
            usable = draw(st.integers(0, 3)) > 0
            rate = draw(st.sampled_from([100.0, 200.0, 400.0, None]))
            hcas = tuple(f"mlx5_{i}" for i in draw(st.sets(st.integers(0, 11), min_size=1, max_size=3)))
            fabrics.append(
                FabricStatus(
                    name=name,
                    declared_hcas=hcas,
                    advertised_hcas=hcas if usable else (),
                    rate_gbps=rate if usable else None,
                    problems=(
                        () if usable else tuple(f"{h}: no ACTIVE port (port 1: INIT, LinkUp)" for h in hcas)
                    ),
                )
            )
    inv = inventory(
        node_id,
        n,
        peers=lambda i: peers[i],
        memory_bytes=lambda i: sizes[i] * GIB,
        fabrics=tuple(fabrics),
        nvlink_known=draw(st.sampled_from([True, True, True, False])),
    )
    # Mostly-free nodes are the interesting ones: a random subset of 16 is
    # rarely big enough for a group.
    busy = draw(st.sets(st.integers(0, n - 1), max_size=draw(st.sampled_from([0, 2, n]))))
    free = set(range(n)) - busy
    if draw(st.integers(0, 9)) == 0:
        free.add(n + 3)  # an index the inventory does not have
    schedulable = draw(st.integers(0, 9)) > 0
    return cap(inv, free=free, schedulable=schedulable, reason=None if schedulable else "unreachable")


def fleet(max_nodes: int, max_gpus: int, fabric_names=(), min_nodes: int = 1):
    return st.integers(min_nodes, max_nodes).flatmap(
        lambda count: st.tuples(*(node(f"gpu-{i:02d}", max_gpus, fabric_names) for i in range(count)))
    )


def single_request():
    return st.builds(
        lambda tp, pp, w: request(tp=tp, pp=pp, weights_gib=w),
        st.sampled_from([1, 2, 2, 3, 4, 4, 8]),
        st.sampled_from([1, 1, 1, 2]),
        st.one_of(st.none(), st.integers(0, 320)),
    )


# --- the slow specification ----------------------------------------------------


def brute_option(c: NodeCapacity, n: int, required: int | None):
    """(gpus, nvlink) this node should give, or None."""
    if not c.schedulable:
        return None
    inv = c.inventory
    mem = {g.index: g.memory_bytes for g in inv.gpus}
    free = sorted(i for i in c.free_gpus if i in mem)
    adj = peer_graph(inv)

    def holds(group):
        return required is None or sum(mem[g] for g in group) >= required

    if n >= 2 and inv.nvlink_known:
        for group in combinations(free, n):
            if all(b in adj[a] for a, b in combinations(group, 2)) and holds(group):
                return group, True
    for group in combinations(free, n):
        if holds(group):
            return group, False
    return None


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
    for s in shards:
        assert len(s.gpu_indices) == p.gpus_per_node
        assert len(set(s.gpu_indices)) == len(s.gpu_indices)
        assert list(s.gpu_indices) == sorted(s.gpu_indices)
        assert set(s.gpu_indices) <= free_of(by_id[s.node_id])
        assert by_id[s.node_id].schedulable
    assert sum(len(s.gpu_indices) for s in shards) == p.gpus_total
    need = memory_need(req, share=p.nodes)
    if need is not None:
        for s in shards:
            inv = by_id[s.node_id].inventory
            assert sum(inv.gpu(g).memory_bytes for g in s.gpu_indices) >= need.required_bytes
    if result.placement.rule == "nvlink":
        (s,) = shards
        adj = peer_graph(by_id[s.node_id].inventory)
        assert all(b in adj[a] for a, b in combinations(s.gpu_indices, 2))
    chosen = {s.node_id for s in shards}
    assert all(v.ok for v in result.verdicts if v.node_id in chosen)


# --- single node -----------------------------------------------------------------


@SETTINGS
@given(nodes=fleet(4, 12), req=single_request())
def test_single_node_matches_brute_force(nodes, req):
    result = place(req, nodes)
    check_invariants(result, req, nodes)
    n = req.profile.gpus_total
    need = memory_need(req)
    required = None if need is None else need.required_bytes
    options = {c.node_id: o for c in nodes if (o := brute_option(c, n, required)) is not None}
    if not options:
        assert result.placement is None
        return
    assert result.placement is not None
    best = min(
        options,
        key=lambda nid: (
            not options[nid][1],
            len(free_of(next(c for c in nodes if c.node_id == nid))) - n,
            nid,
        ),
    )
    (shard,) = result.placement.shards
    assert shard.node_id == best
    gpus, linked = options[best]
    assert shard.gpu_indices == gpus
    # The rule says which: an NVLink set whenever one exists on the chosen node.
    assert result.placement.rule == ("nvlink" if linked else "lowest-free")
    assert {v.node_id for v in result.verdicts if v.ok} == set(options)


@SETTINGS
@given(nodes=fleet(3, 16), req=single_request())
def test_single_node_invariants_up_to_16_gpus(nodes, req):
    check_invariants(place(req, nodes), req, nodes)


# --- multi node ------------------------------------------------------------------


def _rate_key(r):
    return -1.0 if r is None else r


@st.composite
def multi_request(draw):
    k = draw(st.integers(2, 3))
    gpn = draw(st.integers(1, 4))
    pp = draw(st.sampled_from([1, k]))
    tp = gpn * k // pp
    return request(tp=tp, pp=pp, nodes=k, weights_gib=draw(st.one_of(st.none(), st.integers(0, 400))))


@SETTINGS
@given(nodes=fleet(6, 8, ("ib-a", "ib-b"), min_nodes=2), req=multi_request())
def test_multi_node_matches_brute_force(nodes, req):
    result = place(req, nodes)
    check_invariants(result, req, nodes)
    k, gpn = req.profile.nodes, req.profile.gpus_per_node
    need = memory_need(req, share=k)
    required = None if need is None else need.required_bytes
    options = {c.node_id: o for c in nodes if (o := brute_option(c, gpn, required)) is not None}
    eligible: dict[str, list[tuple[str, float | None]]] = {}
    for c in nodes:
        if c.node_id in options:
            for f in c.inventory.fabrics:
                if f.usable:
                    eligible.setdefault(f.name, []).append((c.node_id, f.rate_gbps))
    feasible = {name: ms for name, ms in eligible.items() if len(ms) >= k}
    if not feasible:
        assert result.placement is None
        return
    p = result.placement
    assert p is not None and p.rule == "multi-node"
    # Best achievable slowest link: the k-th fastest node of the best fabric.
    best_rate = max(sorted((_rate_key(r) for _, r in ms), reverse=True)[k - 1] for ms in feasible.values())
    by_id = {c.node_id: c for c in nodes}
    statuses = [by_id[s.node_id].inventory.fabric(p.fabric) for s in p.shards]
    assert all(f is not None and f.usable for f in statuses)
    assert min(_rate_key(f.rate_gbps) for f in statuses) == best_rate
    rates = [f.rate_gbps for f in statuses]
    assert p.fabric_rate_gbps == (None if None in rates else min(rates))
    for s, f in zip(p.shards, statuses):
        assert s.env["NCCL_IB_HCA"] == "=" + ",".join(f.advertised_hcas)
        assert s.gpu_indices == options[s.node_id][0]


# --- many replicas ---------------------------------------------------------------


@SETTINGS
@given(
    nodes=fleet(4, 16, ("ib-a",)),
    reqs=st.lists(st.one_of(single_request(), multi_request()), min_size=1, max_size=6),
)
def test_place_many_never_hands_out_a_gpu_twice(nodes, reqs):
    results = place_many(reqs, nodes)
    assert len(results) == len(reqs)
    taken: dict[str, set[int]] = {}
    for req, result in zip(reqs, results):
        check_invariants(result, req, nodes)
        if result.placement is None:
            continue
        for s in result.placement.shards:
            used = taken.setdefault(s.node_id, set())
            assert not used & set(s.gpu_indices)
            used |= set(s.gpu_indices)
    for c in nodes:
        assert taken.get(c.node_id, set()) <= free_of(c)
