"""The reconciler's fleet capacity places exactly as ``place`` over every node does.

``FleetCapacity`` asks placement about one node per class of interchangeable
nodes (and a placement index for single-node replicas); the claim is that
the answer is the one the whole fleet gives.  Fleets here are built from a
few random boxes, each copied under several node ids with different free
GPUs, so classes hold several nodes and the representatives really matter.
"""

from __future__ import annotations

import dataclasses

from hypothesis import given
from hypothesis import strategies as st
from placement_builders import cap, pcie_pairs, request
from placement_strategies import SETTINGS, box, multi_request, single_request

from llmgw.controlplane.capacity import FleetCapacity
from llmgw.placement.shape import node_key
from llmgw.hardware.types import HardwareInventory
from llmgw.placement import NodeCapacity, place_many


def renamed(inv: HardwareInventory, node_id: str) -> HardwareInventory:
    gpus = tuple(dataclasses.replace(g, uuid=f"GPU-{node_id}-{g.index}") for g in inv.gpus)
    return dataclasses.replace(inv, node_id=node_id, gpus=gpus)


@st.composite
def cloned_fleet(draw) -> list[NodeCapacity]:
    shapes = draw(st.lists(box("proto", 8, ("ib-a", "ib-b")), min_size=1, max_size=3))
    nodes = []
    for i in range(draw(st.integers(2, 10))):
        proto = draw(st.sampled_from(shapes))
        node_id = f"n-{draw(st.integers(0, 999)):03d}-{i}"
        inv = renamed(proto.inventory, node_id)
        all_gpus = [g.index for g in inv.gpus]
        free = frozenset(draw(st.sets(st.sampled_from(all_gpus)))) if draw(st.booleans()) else frozenset(all_gpus)
        ok = draw(st.sampled_from([True, True, True, False]))
        nodes.append(NodeCapacity(inv, free, schedulable=ok, reason=None if ok else "unreachable"))
    return nodes


@SETTINGS
@given(nodes=cloned_fleet(), reqs=st.lists(st.one_of(single_request(), multi_request()), min_size=1, max_size=8))
def test_fleet_capacity_places_as_place_many_does(nodes, reqs):
    expected = place_many(reqs, nodes)
    fleet = FleetCapacity((n, node_key(n.inventory)) for n in nodes)
    for req, want in zip(reqs, expected):
        got = fleet.place(req)
        assert (got.placement is None) == (want.placement is None), (req, got.reason, want.reason)
        if got.placement is None:
            continue
        assert got.placement == want.placement
        fleet.take(got.placement)


def test_interchangeable_nodes_are_one_class_and_the_lowest_id_is_asked():
    nodes = [cap(renamed(pcie_pairs("x"), f"n{i}")) for i in (3, 1, 2)]
    fleet = FleetCapacity((n, node_key(n.inventory)) for n in nodes)
    assert fleet.classes() == 1
    assert [c.node_id for c in fleet.candidates()] == ["n1"]
    assert [c.node_id for c in fleet.candidates(per_class=2)] == ["n1", "n2"]
    placed = fleet.place(request(tp=2)).placement
    assert placed.nodes == ("n1",)
    fleet.take(placed)
    assert fleet.classes() == 2  # n1 now has fewer free GPUs than its twins
    assert [c.node_id for c in fleet.everyone()] == ["n1", "n2", "n3"]


def test_an_unknown_shape_is_compared_with_no_other_node():
    nodes = [cap(renamed(pcie_pairs("x"), f"n{i}")) for i in (1, 2)]
    fleet = FleetCapacity((n, "") for n in nodes)
    assert fleet.classes() == 2
