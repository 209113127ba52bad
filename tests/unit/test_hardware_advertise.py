"""One function turns a node's hardware into what it advertises: the agent's, the control plane's, offline's."""

import dataclasses

from llmgw.controlplane.state import advertised
from llmgw.hardware.advertise import Hold, advertise, listed_holders
from llmgw.hardware.gpu_health import GPUHealth
from llmgw.hardware.types import GPU, GPUProcess, HardwareInventory


def box(n: int = 4) -> HardwareInventory:
    gpus = tuple(GPU(i, f"GPU-{i}", "NVIDIA H100 80GB HBM3", 80 << 30, f"0000:{i:02x}:00.0",
                     nvlink_peers=tuple(j for j in range(n) if j != i)) for i in range(n))
    return HardwareInventory("n1", gpus, gpu_source="simulated")


def test_nothing_to_withhold_gives_the_same_inventory_back():
    inv = box()
    assert advertise(inv).inventory is inv
    assert advertise(inv, foreign=listed_holders).inventory is inv


def test_sick_then_held_then_foreign_each_named_once_in_that_order():
    inv = box()
    gpus = list(inv.gpus)
    gpus[3] = dataclasses.replace(gpus[3], processes=(GPUProcess(4242),))
    gpus[0] = dataclasses.replace(gpus[0], processes=(GPUProcess(77),))
    inv = dataclasses.replace(inv, gpus=tuple(gpus))
    out = advertise(inv, health={0: GPUHealth(xids=(79,))}, since={0: 0.0},
                    held=lambda shown: [Hold((1,), "GPU(s) 1 withheld: held by pid 9")],
                    foreign=listed_holders)
    assert [g.index for g in out.inventory.gpus] == [2]
    assert out.inventory.gpus[0].nvlink_peers == ()
    assert out.inventory.gpu_reason == (
        "GPU 0 withheld: Xid 79 (GPU has fallen off the bus) at 1970-01-01T00:00:00Z; GPU(s) 1 withheld: held by "
        "pid 9; GPU 3 withheld: in use by pid 4242 (listed in the hardware file; offline, every listed process "
        "counts), not an llmgw engine")
    assert [(s.index, s.reason) for s in out.sick] == [(0, "Xid 79 (GPU has fallen off the bus)")]
    assert [(h.gpu, h.pid) for h in out.holders] == [(3, 4242)]  # pid 77 was on the sick GPU: named as sick only


def test_the_control_plane_withholds_a_sick_gpu_an_agent_left_in():
    """An older or faulty agent advertising a GPU whose own health says Xid 79: not given out."""
    inv = box(2)
    doc = inv.to_dict()
    doc["gpus"][1]["health"] = {"xid": [79], "remapped_rows_pending": True}
    got = advertised(doc)
    assert [g.index for g in got.gpus] == [0]
    (sick,) = got.sick_gpus
    assert sick.index == 1 and sick.reason == ("Xid 79 (GPU has fallen off the bus), row remapping pending "
                                               "(takes effect at the next GPU reset)")
    assert got.gpu_reason.startswith("GPU 1 withheld: Xid 79")
    # What a current agent sends (sick GPUs already out, listed in sick_gpus) passes unchanged.
    again = advertised(got.to_dict())
    assert again.to_dict() == got.to_dict()
