"""place_many and format_result: each declared replica in turn, and the text ctl prints."""

from __future__ import annotations

from placement_builders import cap, dead_fabric, good_fabric, nvswitch_h100, pcie_pairs, request

from llmgw.placement import format_result, place, place_many


def test_replicas_take_successive_nvlink_pairs_until_the_node_is_full():
    results = place_many([request(tp=2)] * 5, [cap(nvswitch_h100("gpu-a"))])
    assert [r.placement.shards[0].gpu_indices for r in results[:4]] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert results[4].placement is None
    assert results[4].verdicts[0].reason == "0 free GPUs, needs 2"


def test_earlier_replica_is_seen_by_later_ones_on_pcie():
    # The single-GPU replica breaks pair (0,1); the TP=2 one then takes (2,3).
    results = place_many([request(tp=1), request(tp=2), request(tp=2)], [cap(pcie_pairs("gpu-b"))])
    assert [r.placement.shards[0].gpu_indices if r.ok else None for r in results] == [(0,), (2, 3), None]
    assert results[2].verdicts[0].reason == "1 free GPU, needs 2"


def test_a_refused_replica_takes_nothing():
    nodes = [cap(nvswitch_h100("gpu-a"), free={0, 1, 2, 3})]
    results = place_many([request(tp=8), request(tp=4)], nodes)
    assert results[0].placement is None
    assert results[1].placement.shards[0].gpu_indices == (0, 1, 2, 3)


def test_multi_node_replica_uses_up_gpus_on_every_shard_node():
    fab = (good_fabric(),)
    nodes = [cap(nvswitch_h100("gpu-a", fab)), cap(nvswitch_h100("gpu-b", fab))]
    results = place_many(
        [request(tp=4, nodes=2), request(tp=4, nodes=2), request(tp=4), request(tp=8)], nodes
    )
    assert [[(s.node_id, s.gpu_indices) for s in r.placement.shards] for r in results[:3]] == [
        [("gpu-a", (0, 1)), ("gpu-b", (0, 1))],
        [("gpu-a", (2, 3)), ("gpu-b", (2, 3))],
        [("gpu-a", (4, 5, 6, 7))],
    ]
    assert results[3].placement is None
    assert [v.reason for v in results[3].verdicts] == ["0 free GPUs, needs 8", "4 free GPUs, needs 8"]


def test_input_nodes_are_left_untouched():
    nodes = [cap(nvswitch_h100("gpu-a"))]
    place_many([request(tp=8)], nodes)
    assert nodes[0].free_gpus == frozenset(range(8))


def test_format_placed_result_one_line_then_each_node():
    req = request(tp=2, weights_gib=126)
    nodes = [
        cap(nvswitch_h100("gpu-a")),
        cap(pcie_pairs("gpu-b"), free={0}),
        cap(nvswitch_h100("gpu-c"), schedulable=False, reason="unreachable"),
    ]
    text = format_result(place(req, nodes), req)
    lines = text.splitlines()
    assert lines[0] == (
        "llama-70b/tp2: placed (nvlink): GPUs 0,1 on gpu-a: fully connected by NVLink; "
        "memory: each GPU needs 75.6 GiB (1/2 of weights 126.0 GiB = 63.0 GiB + 20% headroom), "
        "smallest GPU of the group has 80.0 GiB"
    )
    assert lines[1].split(maxsplit=2)[:2] == ["gpu-a", "ok"]
    assert lines[1].endswith("chosen: " + lines[0].split("placed (nvlink): ", 1)[1])
    assert lines[2].split(maxsplit=2) == ["gpu-b", "no", "1 free GPU, needs 2"]
    assert lines[3].split(maxsplit=2) == ["gpu-c", "no", "unreachable"]
    assert len(lines) == 4


def test_format_refusal_leads_with_the_summary():
    req = request(tp=8, pp=2, nodes=2)
    nodes = [cap(nvswitch_h100("gpu-a", (good_fabric(),))), cap(nvswitch_h100("gpu-b", (dead_fabric(),)))]
    lines = format_result(place(req, nodes), req).splitlines()
    assert lines[0] == (
        "no placement for llama-70b/tp8-pp2-n2 (8 GPUs on each of 2 nodes on one fabric): 2 nodes: "
        "1 fabric too small, 1 no usable fabric"
    )
    assert lines[1] == "  gpu-a  no  only 1 node on fabric ib-a has 8 free GPUs, needs 2"
    assert lines[2].startswith(
        "  gpu-b  no  not on a fabric with an active adapter: fabric ib-a problems: mlx5_0"
    )
