"""Placement by score over the topology matrix: whole islands, best fit, the
adapters a multi-node rank talks through, and what each explanation says.

The boxes are the hardware files in tests/fixtures/hardware (see its README).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from placement_builders import cap, inventory, pcie8_two_sockets, request

from llmgw.hardware.simulated import load_hardware_file
from llmgw.hardware.types import FabricStatus
from llmgw.placement import place, place_many

HARDWARE = Path(__file__).parents[1] / "fixtures" / "hardware"


def hw(name: str, node_id: str | None = None):
    return load_hardware_file(HARDWARE / name, node_id=node_id)


def only(result):
    (shard,) = result.placement.shards
    return shard.gpu_indices


def test_group_larger_than_an_island_takes_whole_islands():
    # GPU 0 busy: the lowest free indices (1,2,3,4) would span three islands and both sockets.
    r = place(request(tp=4), [cap(hw("pcie-8gpu-bridged-2socket.yaml"), free=range(1, 8))])
    assert only(r) == (4, 5, 6, 7)
    assert r.placement.rule == "topology"
    assert r.placement.detail.startswith(
        "GPUs 4,5,6,7 on gpu-pcie8-01: 2 NVLink islands (4,5 | 6,7) joined by NODE (host bridges within one "
        "NUMA node); no free set of 4 fully connected by NVLink")


def test_same_without_a_matrix_still_takes_whole_pairs():
    # The failure that was seen: only NVLink peers known, GPU 0 busy, TP=4 went to 1,4,5,6.
    inv = inventory("pairs8", 8, peers=lambda i: [i ^ 1])
    r = place(request(tp=4), [cap(inv, free=range(1, 8))])
    assert only(r) == (2, 3, 4, 5)  # two whole pairs; which two is unknown without the matrix
    assert r.placement.rule == "lowest-free"
    assert "PCIe/NUMA tiers unknown (not discovered)" in r.placement.detail


def test_across_sockets_only_when_no_socket_has_room():
    inv = pcie8_two_sockets("p8")
    r = place(request(tp=4), [cap(inv, free={1, 2, 3, 4, 5, 6})])
    # socket 0 has 1,2,3, socket 1 has 4,5,6: no set of 4 within one NUMA node
    assert r.placement.detail.split("; ")[1] == "no free set of 4 within one NUMA node"
    assert "joined by SYS (the link between NUMA nodes (sockets))" in r.placement.detail
    # the fewest islands: two whole pairs (2,3 and 4,5), not three pieces
    assert only(r) == (2, 3, 4, 5)


def test_tp1_takes_a_gpu_whose_partner_is_busy():
    inv = pcie8_two_sockets("p8")
    r = place(request(tp=1), [cap(inv, free={0, 1, 2, 4, 5, 6, 7})])
    assert only(r) == (2,)
    assert r.placement.rule == "best-fit"
    assert r.placement.detail.startswith("GPU 2 on p8: best fit: GPU 0 would split a free NVLink island")


def test_best_fit_keeps_pairs_for_the_groups_that_come_next():
    inv = pcie8_two_sockets("p8")
    # 3 TP=1 replicas, then 2 TP=2: with best fit every TP=2 still gets an NVLink pair
    # (lowest free indices would have taken 0, 2, 4 and left no pair but 6,7).
    reqs = [request(tp=1)] * 3 + [request(tp=2)] * 2
    results = place_many(reqs, [cap(inv, free={0, 2, 3, 4, 5, 6, 7})])
    assert [only(r) for r in results] == [(0,), (2,), (3,), (4, 5), (6, 7)]
    assert all(r.placement.rule == "nvlink" for r in results[3:])


def test_hgx_board_is_all_nvlink():
    r = place(request(tp=4), [cap(hw("hgx-h100-nvswitch-topology.yaml"))])
    assert only(r) == (0, 1, 2, 3)
    assert "fully connected by NVLink (NV18)" in r.placement.detail


def test_pcie_switches_without_nvlink():
    inv = hw("pcie-4gpu-2switch.yaml")
    r = place(request(tp=2), [cap(inv, free={0, 2, 3})])
    assert only(r) == (2, 3)
    assert "joined by PIX (one PCIe switch)" in r.placement.detail
    r = place(request(tp=3), [cap(inv)])
    assert "joined by PHB (a PCIe host bridge); no free set of 3 behind one PCIe switch" in r.placement.detail


def test_node_with_the_closer_set_wins_over_a_tighter_fit():
    a = cap(pcie8_two_sockets("a"), free={0, 2, 4})  # no pair free: NODE at best
    b = cap(pcie8_two_sockets("b"))
    r = place(request(tp=2), [a, b])
    assert r.placement.nodes == ("b",)
    v = {x.node_id: x for x in r.verdicts}
    assert v["a"].reason.endswith("not chosen: b offers an NVLink-connected set")


def test_unknown_tiers_rank_below_every_known_one():
    def tier(a, b):
        return None if (a, b) == (0, 1) else "SYS"

    from placement_builders import with_tiers

    inv = with_tiers(inventory("u", 3), tier)
    r = place(request(tp=2), [cap(inv)])
    assert only(r) == (0, 2)  # SYS is known; 0-1 is unknown (NVML_ERROR_NOT_SUPPORTED)


def _fabric(name: str, hcas: tuple[str, ...]) -> FabricStatus:
    return FabricStatus(name=name, declared_hcas=hcas, advertised_hcas=hcas, rate_gbps=400.0)


def test_multi_node_ranks_take_gpus_near_the_fabrics_adapters():
    # HGX: every set of 2 is NV18; fabric ib-a has only mlx5_4 and mlx5_5, by GPUs 4 and 5.
    nodes = []
    for n in ("h1", "h2"):
        inv = hw("hgx-h100-nvswitch-topology.yaml", n)
        nodes.append(cap(dataclasses.replace(inv, fabrics=(_fabric("ib-a", ("mlx5_4", "mlx5_5")),))))
    r = place(request(tp=2, pp=2, nodes=2), nodes)
    assert [s.gpu_indices for s in r.placement.shards] == [(4, 5), (4, 5)]
    assert "nearest adapter PIX" in r.placement.detail
    assert all(s.env["NCCL_IB_HCA"] == "=mlx5_4,mlx5_5" for s in r.placement.shards)


def test_links_come_before_adapter_distance():
    # ib-b nodes: islands 0-3 (socket 0, where mlx5_0 is) and 4-7; GPU 0 busy on both.
    nodes = []
    for n in (1, 2):
        inv = hw(f"ib-b-topo-node{n}.yaml")
        nodes.append(cap(dataclasses.replace(inv, fabrics=(_fabric("ib-b", ("mlx5_0",)),)), free=range(1, 8)))
    r = place(request(tp=4, pp=2, nodes=2), nodes)
    # the whole island 4-7 (NV12) beats 1,2,3 + one across the sockets, though mlx5_0 is on socket 0
    assert [s.gpu_indices for s in r.placement.shards] == [(4, 5, 6, 7)] * 2
    assert "nearest adapter SYS" in r.placement.detail
    free = [cap(dataclasses.replace(c.inventory)) for c in nodes]
    r = place(request(tp=4, pp=2, nodes=2), free)
    assert [s.gpu_indices for s in r.placement.shards] == [(0, 1, 2, 3)] * 2
    assert "nearest adapter PIX" in r.placement.detail


@pytest.mark.parametrize("busy", [set(), {0}, {3, 4}, {0, 1, 2, 3}])
def test_same_inputs_same_answer(busy):
    inv = hw("pcie-8gpu-bridged-2socket.yaml")
    free = set(range(8)) - busy
    a = place(request(tp=2), [cap(inv, free=free)])
    b = place(request(tp=2), [cap(hw("pcie-8gpu-bridged-2socket.yaml"), free=free)])
    assert a == b
