"""One node-shape notion: the control plane's capacity classes and the placement index draw on ``node_key``."""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path

from llmgw.controlplane import capacity
from llmgw.hardware.simulated import inventory_from_document, read_hardware_document
from llmgw.hardware.types import FabricStatus
from llmgw.placement import NodeCapacity
from llmgw.placement import shape as shapes
from llmgw.placement.shape import node_key, shape_of

HW = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "hardware"


def box(node_id: str, name: str = "pcie-8gpu-bridged-2socket.yaml"):
    return inventory_from_document(read_hardware_document(HW / name), node_id=node_id)


def test_the_capacity_module_has_no_shape_of_its_own():
    assert not hasattr(capacity, "shape_of")


def test_identities_do_not_change_the_key_and_whatever_placement_reads_does():
    a, b = box("a"), box("b")
    b = dataclasses.replace(b, gpus=tuple(dataclasses.replace(g, uuid=f"GPU-other-{g.index}",
                                                              pci_bus_id=f"0000:{g.index:02x}:00.0") for g in b.gpus))
    assert node_key(a) == node_key(b)
    assert node_key(a)[0] is shape_of(a)  # the index's bucket is the key's first part
    other_model = dataclasses.replace(a, gpus=tuple(dataclasses.replace(g, name="NVIDIA L40S") for g in a.gpus))
    assert node_key(other_model)[0] != node_key(a)[0]
    fabric = FabricStatus("ib-a", ("mlx5_0",), ("mlx5_0",), 400.0)
    assert node_key(dataclasses.replace(a, fabrics=(fabric,))) != node_key(a)
    moved = dataclasses.replace(a, hcas=tuple(dataclasses.replace(h, numa_node=1 - (h.numa_node or 0))
                                              for h in a.hcas))
    assert node_key(moved) != node_key(a)


def test_classes_split_by_gpu_model_and_merge_clones():
    a, b = box("a"), box("b")
    c = dataclasses.replace(box("c"), gpus=tuple(dataclasses.replace(g, name="NVIDIA L40S") for g in box("c").gpus))
    fleet = capacity.FleetCapacity((NodeCapacity(i, frozenset(g.index for g in i.gpus)), node_key(i))
                                   for i in (a, b, c))
    assert fleet.classes() == 2
    assert [n.node_id for n in fleet.candidates()] == ["a", "c"]


def odd(node_id: str):
    """A box no other test builds: its shape is this test's alone."""
    inv = box(node_id)
    return dataclasses.replace(inv, gpus=tuple(dataclasses.replace(g, memory_bytes=12_345_678_901) for g in inv.gpus))


def test_a_shape_is_equal_by_what_it_is_when_the_memo_has_let_go():
    first = shape_of(odd("a"))
    signature = first.signature
    shapes._by_inventory.clear()
    del first
    gc.collect()
    assert signature not in shapes._shapes  # nothing held it: the memo let it go
    again = shape_of(odd("b"))
    assert again.signature == signature and again == shape_of(odd("c")) and hash(again) == hash(shape_of(odd("d")))
