"""Single-node placement: NVLink preference, lowest-free fallback, node choice, refusals."""

from __future__ import annotations

import pytest
from placement_builders import cap, inventory, nvswitch_h100, pcie_pairs, request

from llmgw.hardware.types import HardwareInventory
from llmgw.placement import place


def verdicts(result):
    return {v.node_id: v for v in result.verdicts}


# --- group within a node -----------------------------------------------------


def test_nvswitch_node_gives_lowest_fully_connected_pair():
    r = place(request(tp=2), [cap(nvswitch_h100("gpu-a"))])
    assert r.ok
    (shard,) = r.placement.shards
    assert (shard.node_id, shard.rank, shard.gpu_indices) == ("gpu-a", 0, (0, 1))
    assert r.placement.rule == "nvlink"
    assert r.placement.detail.startswith("GPUs 0,1 on gpu-a: fully connected by NVLink")
    assert shard.env == {}


def test_nvswitch_node_uses_lowest_free_indices_that_are_connected():
    r = place(request(tp=2), [cap(nvswitch_h100("gpu-a"), free={2, 3, 5})])
    assert r.placement.shards[0].gpu_indices == (2, 3)
    assert r.placement.detail.startswith("GPUs 2,3 on gpu-a: fully connected by NVLink")


def test_full_nvswitch_node_for_tp8():
    r = place(request(tp=8), [cap(nvswitch_h100("gpu-a"))])
    assert r.placement.shards[0].gpu_indices == tuple(range(8))
    assert r.placement.rule == "nvlink"


def test_pcie_box_skips_lowest_indices_for_a_bridged_pair():
    # 0 and 2 are the lowest free GPUs, but only 2 and 3 share a bridge.
    r = place(request(tp=2), [cap(pcie_pairs("gpu-b"), free={0, 2, 3})])
    assert r.placement.shards[0].gpu_indices == (2, 3)
    assert r.placement.rule == "nvlink"


def test_pcie_box_without_a_free_pair_falls_back_and_says_why():
    r = place(request(tp=2), [cap(pcie_pairs("gpu-b"), free={0, 2})])
    assert r.placement.shards[0].gpu_indices == (0, 2)
    assert r.placement.rule == "lowest-free"
    assert r.placement.detail.startswith(
        "GPUs 0,2 on gpu-b: lowest free indices; no NVLink-connected set of 2 among free GPUs 0,2"
    )


def test_pcie_box_has_no_nvlink_set_of_four():
    r = place(request(tp=4), [cap(pcie_pairs("gpu-b"))])
    assert r.placement.shards[0].gpu_indices == (0, 1, 2, 3)
    assert r.placement.rule == "lowest-free"
    assert "no NVLink-connected set of 4 among free GPUs 0,1,2,3" in r.placement.detail


def test_unknown_topology_is_said_to_be_unknown():
    inv = inventory("gpu-c", 4, nvlink_known=False)
    r = place(request(tp=2), [cap(inv, free={1, 2, 3})])
    assert r.placement.shards[0].gpu_indices == (1, 2)
    assert r.placement.rule == "lowest-free"
    assert r.placement.detail.startswith("GPUs 1,2 on gpu-c: lowest free indices; NVLink topology unknown")


def test_unknown_topology_ignores_stale_peer_lists():
    # Peers present but the topology flagged unreadable: they are not trusted.
    inv = inventory("gpu-c", 4, peers=lambda i: [i ^ 1], nvlink_known=False)
    r = place(request(tp=2), [cap(inv, free={0, 2, 3})])
    assert r.placement.shards[0].gpu_indices == (0, 2)
    assert "NVLink topology unknown" in r.placement.detail


def test_peer_seen_from_one_side_links_both():
    inv = inventory("gpu-d", 4, peers=lambda i: {2: [3]}.get(i, []))
    r = place(request(tp=2), [cap(inv)])
    assert r.placement.shards[0].gpu_indices == (2, 3)
    assert r.placement.rule == "nvlink"


def test_peer_lists_naming_missing_gpus_or_self_are_ignored():
    inv = inventory("gpu-d", 3, peers=lambda i: [i, 7])
    r = place(request(tp=2), [cap(inv)])
    assert r.placement.rule == "lowest-free"
    assert r.placement.shards[0].gpu_indices == (0, 1)


def test_single_gpu_takes_lowest_free_index():
    r = place(request(tp=1), [cap(nvswitch_h100("gpu-a"), free={5, 3, 7})])
    assert r.placement.shards[0].gpu_indices == (3,)
    assert r.placement.rule == "lowest-free"
    assert r.placement.detail.startswith("GPU 3 on gpu-a: lowest free index")


def test_pipeline_parallel_counts_toward_gpus_on_one_node():
    r = place(request(tp=2, pp=2), [cap(nvswitch_h100("gpu-a"), free={1, 2, 4, 6, 7})])
    assert r.placement.shards[0].gpu_indices == (1, 2, 4, 6)


def test_free_index_the_inventory_lacks_is_never_handed_out():
    r = place(request(tp=2), [cap(pcie_pairs("gpu-b"), free={3, 9})])
    assert not r.ok
    assert verdicts(r)["gpu-b"].reason == "1 free GPU, needs 2"


# --- choosing among nodes ----------------------------------------------------


def test_node_offering_nvlink_beats_a_tighter_fit_without():
    nodes = [cap(pcie_pairs("gpu-b"), free={0, 2}), cap(nvswitch_h100("gpu-a"))]
    r = place(request(tp=2), nodes)
    assert r.placement.nodes == ("gpu-a",)
    v = verdicts(r)
    assert v["gpu-b"].ok
    assert v["gpu-b"].reason.endswith("not chosen: gpu-a offers an NVLink-connected set")
    assert v["gpu-a"].reason.startswith("chosen: GPUs 0,1 on gpu-a")


def test_best_fit_leaves_the_big_free_block_whole():
    nodes = [cap(nvswitch_h100("gpu-a")), cap(nvswitch_h100("gpu-b"), free={4, 5, 6})]
    r = place(request(tp=2), nodes)
    assert r.placement.nodes == ("gpu-b",)
    assert r.placement.shards[0].gpu_indices == (4, 5)
    assert "gpu-b fits better (leaves 1 free GPU, this node 6)" in verdicts(r)["gpu-a"].reason


def test_equal_nodes_are_broken_by_node_id_not_input_order():
    nodes = [cap(nvswitch_h100("gpu-b")), cap(nvswitch_h100("gpu-a"))]
    r = place(request(tp=4), nodes)
    assert r.placement.nodes == ("gpu-a",)
    assert verdicts(r)["gpu-b"].reason.endswith("gpu-a fits as well and comes first by node id")
    # Verdicts keep the caller's order.
    assert [v.node_id for v in r.verdicts] == ["gpu-b", "gpu-a"]


def test_verdicts_list_every_node_when_it_fits():
    nodes = [
        cap(nvswitch_h100("gpu-a")),
        cap(nvswitch_h100("gpu-b"), free=set(), schedulable=False, reason="unreachable"),
        cap(pcie_pairs("gpu-c"), free={3}),
    ]
    r = place(request(tp=2), nodes)
    assert r.ok
    assert [(v.node_id, v.ok) for v in r.verdicts] == [("gpu-a", True), ("gpu-b", False), ("gpu-c", False)]
    assert r.verdicts[1].reason == "unreachable"
    assert r.verdicts[2].reason == "1 free GPU, needs 2"


# --- nothing fits ------------------------------------------------------------


def test_nothing_fits_lists_every_node_with_its_reason():
    empty = HardwareInventory(
        node_id="gpu-e", gpus=(), gpu_source="nvml", gpu_reason="NVML: driver not loaded"
    )
    nodes = [
        cap(nvswitch_h100("gpu-a"), free={0, 1}),
        cap(nvswitch_h100("gpu-b"), schedulable=False, reason="unreachable"),
        cap(nvswitch_h100("gpu-c"), schedulable=False, reason="draining"),
        cap(pcie_pairs("gpu-d"), free=set()),
        cap(empty, free=set()),
    ]
    r = place(request(tp=4), nodes)
    assert r.placement is None
    assert [(v.node_id, v.ok, v.reason) for v in r.verdicts] == [
        ("gpu-a", False, "2 free GPUs, needs 4"),
        ("gpu-b", False, "unreachable"),
        ("gpu-c", False, "not schedulable: draining"),
        ("gpu-d", False, "0 free GPUs, needs 4"),
        ("gpu-e", False, "no GPUs (NVML: driver not loaded), needs 4"),
    ]
    assert r.reason == (
        "no placement for llama-70b/tp4 (4 GPUs on one node): 5 nodes: "
        "3 too few free GPUs, 1 unreachable, 1 not schedulable"
    )


def test_not_schedulable_without_reason_still_says_so():
    r = place(request(tp=1), [cap(nvswitch_h100("gpu-a"), schedulable=False)])
    assert r.verdicts[0].reason == "not schedulable: no reason given"


def test_no_nodes_at_all():
    r = place(request(tp=1), [])
    assert r.placement is None and r.verdicts == ()
    assert r.reason == "no placement for llama-70b/tp1 (1 GPU on one node): no nodes known"


def test_node_listed_twice_is_considered_once():
    n = cap(nvswitch_h100("gpu-a"))
    r = place(request(tp=2), [n, n])
    assert [v.node_id for v in r.verdicts] == ["gpu-a"]


@pytest.mark.parametrize(
    ("tp", "pp", "nodes", "expected"),
    [
        (
            3,
            1,
            2,
            "3 GPUs (tensor_parallel_size 3 x pipeline_parallel_size 1) do not split evenly across 2 nodes",
        ),
        (
            1,
            1,
            2,
            "1 GPUs (tensor_parallel_size 1 x pipeline_parallel_size 1) do not split evenly across 2 nodes",
        ),
        (0, 1, 1, "tensor_parallel_size must be at least 1, got 0"),
        (2, 1, 0, "nodes must be at least 1, got 0"),
    ],
)
def test_profile_that_cannot_split_is_refused_on_every_node(tp, pp, nodes, expected):
    req = request(tp=tp, pp=pp, nodes=nodes, profile="bad")
    r = place(req, [cap(nvswitch_h100("gpu-a")), cap(nvswitch_h100("gpu-b"))])
    assert r.placement is None
    assert [v.node_id for v in r.verdicts] == ["gpu-a", "gpu-b"]
    assert all(not v.ok and v.reason == f"profile bad: {expected}" for v in r.verdicts)
    assert r.reason == f"no placement for llama-70b/bad: profile bad: {expected}"


def test_node_with_withheld_gpus_says_why_it_has_fewer():
    import dataclasses

    inv = dataclasses.replace(nvswitch_h100("gpu-w"), gpu_reason="GPU(s) 2, 3 withheld: held by pid 4242")
    r = place(request(tp=4), [cap(inv, free={0, 1})])
    assert r.placement is None
    assert r.verdicts[0].reason == "2 free GPUs (GPU(s) 2, 3 withheld: held by pid 4242), needs 4"
