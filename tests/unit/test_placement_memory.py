"""The memory check: each GPU must hold its share of the weights plus headroom, before any launch."""

from __future__ import annotations

import pytest
from placement_builders import GIB, cap, good_fabric, inventory, nvswitch_h100, request

from llmgw.placement import place


def test_fitting_group_states_the_numbers():
    r = place(request(tp=2, weights_gib=126), [cap(nvswitch_h100("gpu-a"))])
    assert r.ok
    assert r.placement.detail == (
        "GPUs 0,1 on gpu-a: fully connected by NVLink; "
        "memory: each GPU needs 75.6 GiB (1/2 of weights 126.0 GiB = 63.0 GiB + 20% headroom), "
        "smallest GPU of the group has 80.0 GiB"
    )


def test_too_small_group_is_refused_with_the_numbers():
    r = place(request(tp=2, weights_gib=140), [cap(nvswitch_h100("gpu-a"))])
    assert r.placement is None
    (v,) = r.verdicts
    assert (v.node_id, v.ok) == ("gpu-a", False)
    assert v.reason == (
        "GPU memory too small: each GPU needs 84.0 GiB (1/2 of weights 140.0 GiB = 70.0 GiB + 20% headroom), "
        "0 of 8 free GPUs hold it (largest has 80.0 GiB), needs 2"
    )
    assert r.reason.endswith("1 node: 1 GPU memory too small")


def test_exactly_enough_is_enough():
    r = place(request(tp=2, weights_gib=160, headroom=0.0), [cap(nvswitch_h100("gpu-a"))])
    assert r.ok
    assert "each GPU needs 80.0 GiB (1/2 of weights 160.0 GiB = 80.0 GiB + 0% headroom)" in r.placement.detail
    r = place(request(tp=2, weights_gib=160, headroom=0.01), [cap(nvswitch_h100("gpu-a"))])
    assert not r.ok


def test_unknown_weights_are_not_checked_and_say_so():
    r = place(request(tp=1, weights_gib=None), [cap(inventory("small", 1, memory_bytes=8 * GIB))])
    assert r.ok
    assert r.placement.detail == "GPU 0 on small: lowest free index; weights size unknown: memory not checked"


def test_small_gpus_are_refused_while_large_ones_take_the_replica():
    nodes = [
        cap(inventory("l4-box", 8, peers=lambda i: [j for j in range(8) if j != i], memory_bytes=24 * GIB)),
        cap(nvswitch_h100("gpu-a")),
    ]
    r = place(request(tp=2, weights_gib=70), nodes)
    assert r.placement.nodes == ("gpu-a",)
    v = {x.node_id: x for x in r.verdicts}
    assert not v["l4-box"].ok
    assert v["l4-box"].reason == (
        "GPU memory too small: each GPU needs 42.0 GiB (1/2 of weights 70.0 GiB = 35.0 GiB + 20% headroom), "
        "0 of 8 free GPUs hold it (largest has 24.0 GiB), needs 2"
    )


def _mixed(mem_gib, peers=lambda i: ()):
    return inventory("mixed", len(mem_gib), peers=peers, memory_bytes=lambda i: mem_gib[i] * GIB)


def test_mixed_board_picks_nvlink_set_that_holds_the_weights():
    everyone = lambda i: [j for j in range(4) if j != i]  # noqa: E731
    r = place(request(tp=2, weights_gib=100), [cap(_mixed([24, 24, 80, 80], everyone))])
    assert r.placement.shards[0].gpu_indices == (2, 3)
    assert r.placement.rule == "nvlink"


def test_mixed_board_says_when_nvlink_sets_are_too_small():
    # (0,1) is bridged but 48 GiB; (2,3) holds the weights but is not bridged.
    r = place(
        request(tp=2, weights_gib=100), [cap(_mixed([24, 24, 80, 80], lambda i: [1] if i == 0 else []))]
    )
    assert r.placement.shards[0].gpu_indices == (2, 3)
    assert r.placement.rule == "lowest-free"
    assert r.placement.detail.startswith(
        "GPUs 2,3 on mixed: lowest free indices; no NVLink-connected set of 2 among free GPUs 2,3 that hold their share"
    )


@pytest.mark.parametrize(
    ("weights", "expected"),
    # 80 GiB + 20% over 2 GPUs is 48 GiB each: the 24 GiB cards cannot take part.
    [(80, (0, 2)), (125, (0, 2)), (140, None), (30, (0, 1))],
)
def test_mixed_board_without_nvlink_takes_lowest_indices_that_each_hold(weights, expected):
    r = place(request(tp=2, weights_gib=weights), [cap(_mixed([80, 24, 80, 24]))])
    assert (r.placement.shards[0].gpu_indices if r.ok else None) == expected


def test_each_gpu_must_hold_its_share_not_the_group_total():
    # A 48 GB and a 24 GB card add up to 72 GiB, but TP=2 puts 30 GiB on each.
    r = place(request(tp=2, weights_gib=50), [cap(_mixed([48, 24]))])
    assert not r.ok
    assert r.verdicts[0].reason == (
        "GPU memory too small: each GPU needs 30.0 GiB (1/2 of weights 50.0 GiB = 25.0 GiB + 20% headroom), "
        "1 of 2 free GPUs holds it (largest has 48.0 GiB), needs 2"
    )


def test_mixed_board_refusal_names_the_largest_group():
    r = place(request(tp=2, weights_gib=200), [cap(_mixed([80, 24, 80, 24]))])
    assert r.verdicts[0].reason == (
        "GPU memory too small: each GPU needs 120.0 GiB (1/2 of weights 200.0 GiB = 100.0 GiB + 20% headroom), "
        "0 of 4 free GPUs hold it (largest has 80.0 GiB), needs 2"
    )


def test_multi_node_checks_each_node_for_its_share():
    fabric = (good_fabric(),)
    nodes = [cap(nvswitch_h100("gpu-a", fabric)), cap(nvswitch_h100("gpu-b", fabric))]
    # 2 nodes x 4 GPUs x 80 GiB: each of the 8 GPUs holds 1/8 of 600 GiB plus 20%.
    r = place(request(tp=4, pp=2, nodes=2, weights_gib=600), nodes)
    assert r.placement is None
    assert [v.reason for v in r.verdicts] == [
        "GPU memory too small: each GPU needs 90.0 GiB (1/8 of weights 600.0 GiB = 75.0 GiB + 20% headroom), "
        "0 of 8 free GPUs hold it (largest has 80.0 GiB), needs 4"
    ] * 2
    ok = place(request(tp=4, pp=2, nodes=2, weights_gib=500), nodes)
    assert ok.ok
    assert ok.placement.detail.endswith(
        "memory: each GPU needs 75.0 GiB (1/8 of weights 500.0 GiB = 62.5 GiB + 20% headroom)"
    )


def test_negative_sizes_are_a_caller_error():
    with pytest.raises(ValueError, match="weights_bytes"):
        place(request(tp=1, weights_gib=-1), [cap(nvswitch_h100("gpu-a"))])
    with pytest.raises(ValueError, match="memory_headroom"):
        place(request(tp=1, weights_gib=1, headroom=-0.5), [cap(nvswitch_h100("gpu-a"))])
