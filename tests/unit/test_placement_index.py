"""The fleet index reaches the same node and GPUs as ``place()``, replica after replica."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from placement_builders import cap, inventory, pcie8_two_sockets, request
from placement_strategies import SETTINGS, fleet, multi_request, single_request

from llmgw.placement import PlacementIndex, place, place_many


@SETTINGS
@given(nodes=fleet(5, 8, ("ib-a",)), reqs=st.lists(st.one_of(single_request(), multi_request()), min_size=1,
                                                    max_size=8))
def test_index_places_as_place_many_does(nodes, reqs):
    expected = place_many(reqs, nodes)
    index = PlacementIndex(nodes)
    for req, want in zip(reqs, expected):
        got = index.place(req)
        assert (got.placement is None) == (want.placement is None)
        if got.placement is None:
            assert got.reason.startswith(f"no placement for {req.model.name}/{req.profile.name}")
            continue
        assert got.placement == want.placement
        index.take(got.placement)


def test_release_and_update_move_nodes_between_buckets():
    a, b = cap(pcie8_two_sockets("a")), cap(pcie8_two_sockets("b"))
    index = PlacementIndex([a, b])
    r = index.place(request(tp=2))
    assert r.placement.nodes == ("a",) and r.placement.shards[0].gpu_indices == (0, 1)
    index.take(r.placement)
    # a has 6 free now: a TP=2 still prefers a (fewer GPUs left over) and its next whole pair
    r2 = index.place(request(tp=2))
    assert r2.placement.nodes == ("a",) and r2.placement.shards[0].gpu_indices == (2, 3)
    index.release("a", (0, 1))
    assert index.place(request(tp=8)).placement.nodes == ("a",)
    index.update(cap(pcie8_two_sockets("a"), schedulable=False, reason="draining"))
    assert index.place(request(tp=8)).placement.nodes == ("b",)
    assert index.place(request(tp=8)) == index.place(request(tp=8))  # nothing taken by asking


def test_refusal_counts_nodes_by_reason():
    nodes = [cap(pcie8_two_sockets("a"), free={0}), cap(inventory("small", 2, memory_bytes=8 << 30)),
             cap(pcie8_two_sockets("c"), schedulable=False, reason="unreachable")]
    r = PlacementIndex(nodes).place(request(tp=2, weights_gib=70))
    assert r.placement is None and r.verdicts == ()
    assert r.reason == ("no placement for llama-70b/tp2 (2 GPUs on one node): 3 nodes: 1 GPU memory too small, "
                        "1 too few free GPUs, 1 unreachable")
    full = place(request(tp=2, weights_gib=70), nodes)
    assert full.placement is None and len(full.verdicts) == 3


def test_sync_keeps_one_index_across_passes():
    a, b, c = (cap(pcie8_two_sockets(n)) for n in "abc")
    index = PlacementIndex([a, b, c])
    assert index.sync([a, b, c]) == 0  # nothing changed: nothing re-bucketed
    taken = cap(a.inventory, free=set(range(2, 8)))
    gone_b = [taken, c]
    assert index.sync(gone_b) == 2  # a's GPUs changed, b left the fleet
    assert [n.node_id for n in index.nodes()] == ["a", "c"]
    r = index.place(request(tp=8))
    assert r.placement.nodes == ("c",)
    assert index.place(request(tp=2)).placement == place(request(tp=2), [taken, c]).placement
