"""Hypothesis strategies for placement (no tests here): random boxes drawn as real
ones are built, fleets of them, and requests."""

from __future__ import annotations

import random
from itertools import combinations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from placement_builders import GIB, cap, inventory, request, with_tiers

from llmgw.hardware.types import FabricStatus
from llmgw.placement import NodeCapacity


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def box(draw, node_id: str, max_gpus: int, fabric_names=()) -> NodeCapacity:
    n = draw(st.integers(1, max_gpus))
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    # Where each GPU sits: (socket, root complex, switch).
    place_of = [(rng.randrange(2), rng.randrange(2), rng.randrange(2)) for _ in range(n)]
    nv_kind = draw(st.sampled_from(["pairs", "islands", "all", "none", "random"]))
    unknown = draw(st.sampled_from([0.0, 0.0, 0.2]))

    def nv(a: int, b: int) -> bool:
        if nv_kind == "pairs":
            return a // 2 == b // 2
        if nv_kind == "islands":
            return a // 4 == b // 4
        if nv_kind == "all":
            return True
        if nv_kind == "random":
            return rng.random() < 0.4
        return False

    tiers = {}
    for a, b in combinations(range(n), 2):
        if rng.random() < unknown:
            tiers[(a, b)] = None
        elif nv(a, b):
            tiers[(a, b)] = "NV"
        else:
            (sa, ra, wa), (sb, rb, wb) = place_of[a], place_of[b]
            tiers[(a, b)] = ("PIX" if (sa, ra, wa) == (sb, rb, wb) else "PHB" if (sa, ra) == (sb, rb)
                             else "NODE" if sa == sb else "SYS")
    sizes = (
        [draw(st.sampled_from([24, 48, 80]))] * n
        if draw(st.booleans())
        else draw(st.lists(st.sampled_from([24, 48, 80]), min_size=n, max_size=n))
    )
    fabrics = []
    for name in fabric_names:
        if draw(st.integers(0, 3)) > 0:
            usable = draw(st.integers(0, 3)) > 0
            rate = draw(st.sampled_from([100.0, 200.0, 400.0, None]))
            hcas = tuple(f"mlx5_{i}" for i in draw(st.sets(st.integers(0, 11), min_size=1, max_size=3)))
            fabrics.append(FabricStatus(
                name=name, declared_hcas=hcas, advertised_hcas=hcas if usable else (),
                rate_gbps=rate if usable else None,
                problems=() if usable else tuple(f"{h}: no ACTIVE port (port 1: INIT, LinkUp)" for h in hcas)))
    inv = inventory(node_id, n, memory_bytes=lambda i: sizes[i] * GIB, fabrics=tuple(fabrics))
    if draw(st.integers(0, 4)) > 0:
        inv = with_tiers(inv, lambda a, b: tiers[(a, b)], lambda a, b: 4)
    else:  # no matrix: only NVLink peers known
        import dataclasses
        peers = {i: tuple(j for j in range(n) if j != i and tiers.get((min(i, j), max(i, j))) == "NV")
                 for i in range(n)}
        inv = dataclasses.replace(inv, gpus=tuple(dataclasses.replace(g, nvlink_peers=peers[g.index])
                                                  for g in inv.gpus))
    busy = draw(st.sets(st.integers(0, n - 1), max_size=draw(st.sampled_from([0, 2, n]))))
    free = set(range(n)) - busy
    if draw(st.integers(0, 9)) == 0:
        free.add(n + 3)  # an index the inventory does not have
    schedulable = draw(st.integers(0, 9)) > 0
    return cap(inv, free=free, schedulable=schedulable, reason=None if schedulable else "unreachable")


def fleet(max_nodes: int, max_gpus: int, fabric_names=(), min_nodes: int = 1):
    return st.integers(min_nodes, max_nodes).flatmap(
        lambda count: st.tuples(*(box(f"gpu-{i:02d}", max_gpus, fabric_names) for i in range(count)))
    )


def single_request():
    return st.builds(
        lambda tp, pp, w: request(tp=tp, pp=pp, weights_gib=w),
        st.sampled_from([1, 2, 2, 3, 4, 4, 8]),
        st.sampled_from([1, 1, 1, 2]),
        st.one_of(st.none(), st.integers(0, 320)),
    )


@st.composite
def multi_request(draw):
    k = draw(st.integers(2, 3))
    gpn = draw(st.integers(1, 4))
    pp = draw(st.sampled_from([1, k]))
    tp = gpn * k // pp
    return request(tp=tp, pp=pp, nodes=k, weights_gib=draw(st.one_of(st.none(), st.integers(0, 400))))
