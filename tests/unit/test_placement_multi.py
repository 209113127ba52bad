"""Multi-node placement: one fabric, validated adapters only, slowest link decides."""

from __future__ import annotations

from placement_builders import (
    cap,
    dead_fabric,
    degraded_fabric,
    good_fabric,
    nvswitch_h100,
    pcie_pairs,
    request,
)

from llmgw.hardware.types import FabricStatus
from llmgw.placement import nccl_ib_hca, place

TP8_PP2 = dict(tp=8, pp=2, nodes=2)  # 8 GPUs on each of 2 nodes


def verdicts(result):
    return {v.node_id: v for v in result.verdicts}


def test_two_nodes_on_one_fabric_get_exact_adapter_lists():
    nodes = [
        cap(nvswitch_h100("gpu-a", (good_fabric("ib-a", ("mlx5_0", "mlx5_1"), 400.0),))),
        cap(nvswitch_h100("gpu-b", (degraded_fabric("ib-a", 200.0),))),
    ]
    r = place(request(**TP8_PP2), nodes)
    assert r.ok
    p = r.placement
    assert p.rule == "multi-node"
    assert p.fabric == "ib-a"
    assert p.fabric_rate_gbps == 200.0
    assert [(s.node_id, s.rank, s.gpu_indices) for s in p.shards] == [
        ("gpu-a", 0, tuple(range(8))),
        ("gpu-b", 1, tuple(range(8))),
    ]
    # Only this node's ACTIVE adapters, exact-match syntax.
    assert p.shards[0].env == {"NCCL_IB_HCA": "=mlx5_0,mlx5_1"}
    assert p.shards[1].env == {"NCCL_IB_HCA": "=mlx5_0"}
    assert p.detail.startswith(
        "2 nodes on fabric ib-a (200 Gb/s, slowest link): rank 0: GPUs 0,1,2,3,4,5,6,7 on gpu-a"
    )
    assert "weights size unknown: memory not checked" in p.detail
    v = verdicts(r)
    assert v["gpu-a"].reason.startswith(
        "chosen: rank 0, GPUs 0,1,2,3,4,5,6,7 on gpu-a: fully connected by NVLink"
    )
    assert v["gpu-a"].reason.endswith("fabric ib-a via mlx5_0, mlx5_1 (400 Gb/s)")


def test_adapter_names_are_never_left_as_prefixes():
    # mlx5_1 as a bare prefix would also pick mlx5_10..mlx5_19.
    fab = FabricStatus(
        name="ib-a",
        declared_hcas=("mlx5_1", "mlx5_10"),
        advertised_hcas=("mlx5_1",),
        rate_gbps=400.0,
        problems=("mlx5_10: not present on this node",),
    )
    nodes = [
        cap(nvswitch_h100("gpu-a", (fab,))),
        cap(nvswitch_h100("gpu-b", (good_fabric("ib-a", ("mlx5_1",)),))),
    ]
    r = place(request(**TP8_PP2), nodes)
    assert [s.env["NCCL_IB_HCA"] for s in r.placement.shards] == ["=mlx5_1", "=mlx5_1"]
    assert nccl_ib_hca(["mlx5_0", "mlx5_1", "mlx5_0"]) == "=mlx5_0,mlx5_1"


def test_node_whose_adapters_are_down_is_left_out_with_the_adapters_named():
    nodes = [
        cap(nvswitch_h100("gpu-a", (good_fabric(),))),
        cap(nvswitch_h100("gpu-b", (dead_fabric(),))),
        cap(nvswitch_h100("gpu-c", (good_fabric(),))),
    ]
    r = place(request(**TP8_PP2), nodes)
    assert r.placement.nodes == ("gpu-a", "gpu-c")
    v = verdicts(r)["gpu-b"]
    assert not v.ok
    assert v.reason == (
        "not on a fabric with an active adapter: fabric ib-a problems: "
        "mlx5_0: not present on this node; mlx5_1: no ACTIVE port (port 1: DOWN, Disabled)"
    )


def test_nodes_on_different_fabrics_are_never_combined():
    nodes = [
        cap(nvswitch_h100("gpu-a", (good_fabric("ib-a"),))),
        cap(nvswitch_h100("gpu-b", (good_fabric("ib-b"),))),
        cap(nvswitch_h100("gpu-c"), free={0, 1}),
        cap(nvswitch_h100("gpu-d")),
    ]
    r = place(request(**TP8_PP2), nodes)
    assert r.placement is None
    assert [(v.node_id, v.ok, v.reason) for v in r.verdicts] == [
        ("gpu-a", False, "only 1 node on fabric ib-a has 8 free GPUs, needs 2"),
        ("gpu-b", False, "only 1 node on fabric ib-b has 8 free GPUs, needs 2"),
        ("gpu-c", False, "2 free GPUs, needs 8"),
        ("gpu-d", False, "not on a fabric with an active adapter: no fabric declared"),
    ]
    assert r.reason == (
        "no placement for llama-70b/tp8-pp2-n2 (8 GPUs on each of 2 nodes on one fabric): 4 nodes: "
        "2 fabric too small, 1 too few free GPUs, 1 no usable fabric"
    )


def test_fabric_too_small_counts_only_nodes_that_could_take_a_shard():
    nodes = [
        cap(nvswitch_h100("gpu-a", (good_fabric(),))),
        cap(nvswitch_h100("gpu-b", (good_fabric(),)), free={0, 1, 2}),
        cap(nvswitch_h100("gpu-c", (good_fabric(),)), schedulable=False, reason="unreachable"),
    ]
    r = place(request(tp=8, nodes=2), nodes)
    assert r.placement is None
    assert [(v.node_id, v.ok, v.reason) for v in r.verdicts] == [
        ("gpu-a", False, "only 1 node on fabric ib-a has 4 free GPUs, needs 2"),
        ("gpu-b", False, "3 free GPUs, needs 4"),
        ("gpu-c", False, "unreachable"),
    ]


def test_fastest_fabric_wins():
    nodes = [
        cap(nvswitch_h100("gpu-a", (good_fabric("ib-slow", rate=200.0),))),
        cap(nvswitch_h100("gpu-b", (good_fabric("ib-slow", rate=200.0),))),
        cap(nvswitch_h100("gpu-c", (good_fabric("ib-fast", rate=400.0),))),
        cap(nvswitch_h100("gpu-d", (good_fabric("ib-fast", rate=400.0),))),
    ]
    r = place(request(**TP8_PP2), nodes)
    assert r.placement.fabric == "ib-fast"
    assert r.placement.fabric_rate_gbps == 400.0
    assert r.placement.nodes == ("gpu-c", "gpu-d")
    assert verdicts(r)["gpu-a"].reason.endswith("not chosen: fabric ib-fast preferred (400 Gb/s)")


def test_slow_link_is_left_out_when_enough_fast_nodes_exist():
    nodes = [
        cap(nvswitch_h100("gpu-a", (good_fabric(rate=100.0),)), free={0, 1, 2, 3}),
        cap(nvswitch_h100("gpu-b", (good_fabric(rate=400.0),))),
        cap(nvswitch_h100("gpu-c", (good_fabric(rate=400.0),))),
    ]
    r = place(request(tp=4, nodes=2, pp=2), nodes)
    assert r.placement.nodes == ("gpu-b", "gpu-c")
    assert r.placement.fabric_rate_gbps == 400.0
    assert "its link on ib-a (100 Gb/s) is slower than 400 Gb/s" in verdicts(r)["gpu-a"].reason


def test_fewest_stranded_then_node_id():
    fab = (good_fabric(),)
    nodes = [
        cap(nvswitch_h100("gpu-a", fab)),
        cap(nvswitch_h100("gpu-d", fab), free={4, 5, 6, 7}),
        cap(nvswitch_h100("gpu-c", fab), free={0, 1, 2, 3}),
        cap(nvswitch_h100("gpu-b", fab), free={0, 1, 2, 3}),
    ]
    r = place(request(tp=4, pp=2, nodes=2), nodes)
    # Three exact fits; node id picks gpu-b and gpu-c, rank 0 first.
    assert r.placement.nodes == ("gpu-b", "gpu-c")
    assert [s.rank for s in r.placement.shards] == [0, 1]
    v = verdicts(r)
    assert v["gpu-a"].reason.endswith("not chosen: enough nodes fit better")
    assert v["gpu-d"].reason.endswith("not chosen: enough nodes fit as well and come first by node id")


def test_nvlink_preference_applies_inside_each_node():
    fab = (good_fabric(),)
    nodes = [cap(pcie_pairs("gpu-a", fab), free={0, 2, 3}), cap(pcie_pairs("gpu-b", fab), free={1, 2, 3})]
    r = place(request(tp=2, pp=2, nodes=2), nodes)
    assert [s.gpu_indices for s in r.placement.shards] == [(2, 3), (2, 3)]


def test_nodes_offering_nvlink_groups_are_preferred_at_equal_rate():
    fab = (good_fabric(),)
    nodes = [
        cap(pcie_pairs("gpu-a", fab), free={0, 2}),  # exact fit but no bridge
        cap(pcie_pairs("gpu-b", fab), free={0, 1, 2, 3}),
        cap(pcie_pairs("gpu-c", fab), free={0, 1, 2, 3}),
    ]
    r = place(request(tp=2, pp=2, nodes=2), nodes)
    assert r.placement.nodes == ("gpu-b", "gpu-c")
    assert verdicts(r)["gpu-a"].reason.endswith("not chosen: enough nodes offer NVLink-connected sets")


def test_unknown_rate_is_reported_as_unknown_and_ranks_last():
    nodes = [
        cap(nvswitch_h100("gpu-a", (good_fabric("ib-a", rate=None),))),
        cap(nvswitch_h100("gpu-b", (good_fabric("ib-a", rate=400.0),))),
    ]
    r = place(request(**TP8_PP2), nodes)
    assert r.placement.fabric_rate_gbps is None
    assert "(rate unknown, slowest link)" in r.placement.detail


def test_node_on_two_fabrics_can_use_the_one_that_has_peers():
    nodes = [
        cap(
            nvswitch_h100(
                "gpu-a", (good_fabric("ib-a", ("mlx5_0",)), good_fabric("ib-b", ("mlx5_4", "mlx5_5")))
            )
        ),
        cap(nvswitch_h100("gpu-b", (good_fabric("ib-b", ("mlx5_4",)), dead_fabric("ib-c")))),
    ]
    r = place(request(**TP8_PP2), nodes)
    assert r.placement.fabric == "ib-b"
    assert [s.env["NCCL_IB_HCA"] for s in r.placement.shards] == ["=mlx5_4,mlx5_5", "=mlx5_4"]


def test_fabric_shortfall_also_names_broken_fabrics_on_the_node():
    nodes = [
        cap(nvswitch_h100("gpu-a", (good_fabric("ib-a"), dead_fabric("ib-b")))),
        cap(nvswitch_h100("gpu-b", (degraded_fabric("ib-c"),)), free={0}),
    ]
    r = place(request(**TP8_PP2), nodes)
    assert r.placement is None
    assert verdicts(r)["gpu-a"].reason == (
        "only 1 node on fabric ib-a has 8 free GPUs, needs 2; fabric ib-b problems: "
        "mlx5_0: not present on this node; mlx5_1: no ACTIVE port (port 1: DOWN, Disabled)"
    )


def test_tensor_parallel_split_across_nodes():
    fab = (good_fabric(),)
    nodes = [cap(nvswitch_h100("gpu-a", fab), free={6, 7}), cap(nvswitch_h100("gpu-b", fab), free={0, 1, 5})]
    r = place(request(tp=4, nodes=2), nodes)
    assert [(s.node_id, s.gpu_indices) for s in r.placement.shards] == [("gpu-a", (6, 7)), ("gpu-b", (0, 1))]
