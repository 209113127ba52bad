"""The topology matrix: every GPU pair's tier from NVML, where each GPU and
adapter sits from sysfs, and unknown kept unknown.

NVML is ``FakeNvml`` (the real bindings' names, constants and errors); the
PCI tree is ``tests/fixtures/sysfs/pcie8``, a two-socket box in the kernel's
layout: per root complex one PCIe switch with two GPUs and one adapter.
"""

from __future__ import annotations

import ctypes

from pathlib import Path

import pynvml
import pytest

from llmgw.config import schema_errors
from llmgw.hardware import discover
from llmgw.hardware.infiniband import read_hcas
from llmgw.hardware.nvml import discover_gpus, nvlink_counts, LinkReport
from llmgw.hardware.matrix import topo_matrix
from llmgw.hardware.topology import cpulist, pci_tier
from llmgw.hardware.types import HardwareInventory
from nvml_fake import Dev, FakeNvml, bus, hgx_a100

SYSFS = Path(__file__).parents[1] / "fixtures" / "sysfs"
PCIE8 = SYSFS / "pcie8"
# The GPUs of pcie8, in NVML (bus) order: two per switch.
PCIE8_BUSES = [0x19, 0x1A, 0x3D, 0x3E, 0x9D, 0x9E, 0xBD, 0xBE]
L = pynvml


def pcie8_nvml(**kw) -> FakeNvml:
    """Bridged pairs (0,1)(2,3)(4,5)(6,7), the PCIe levels of pcie8's tree."""
    devs = []
    for i, b in enumerate(PCIE8_BUSES):
        mate = PCIE8_BUSES[i ^ 1]
        devs.append(Dev(bus(b), links={0: bus(mate), 1: bus(mate), 2: bus(mate), 3: bus(mate)},
                        numa=0 if i < 4 else 1, cpus=(0xFFFF,) if i < 4 else (0xFFFF0000,)))
    levels = {}
    for a in range(8):
        for c in range(a + 1, 8):
            if a // 2 == c // 2:
                levels[(a, c)] = L.NVML_TOPOLOGY_SINGLE
            elif a // 4 == c // 4:
                levels[(a, c)] = L.NVML_TOPOLOGY_NODE
            else:
                levels[(a, c)] = L.NVML_TOPOLOGY_SYSTEM
    levels.update(kw.pop("levels", {}))
    return FakeNvml(devs, levels=levels, **kw)


def test_every_pair_gets_the_tier_nvidia_smi_shows():
    found = discover_gpus(pcie8_nvml(), sys_root=PCIE8)
    topo = found.topology
    assert topo is not None and len(topo.links) == 28
    assert topo.link(0, 1).tier == "NV" and topo.link(0, 1).nvlinks == 4
    assert topo.link(0, 2).tier == "NODE" and topo.link(1, 3).tier == "NODE"
    assert topo.link(0, 4).tier == "SYS" and topo.link(3, 7).tier == "SYS"
    assert all(link.reason is None for link in topo.links)
    g = {x.index: x for x in found.gpus}
    assert g[0].numa_node == 0 and g[5].numa_node == 1
    assert g[0].cpu_affinity == "0-15" and g[5].cpu_affinity == "16-31"
    assert g[0].pci_path == ("pci0000:16", "0000:16:02.0", "0000:17:00.0", "0000:18:00.0", "0000:19:00.0")
    inv = discover("n1", sysfs_root=PCIE8 / "class" / "infiniband", nvml=pcie8_nvml())
    text = topo_matrix(inv)
    assert text.splitlines()[1].split() == ["GPU0", "X", "NV4", "NODE", "NODE", "SYS", "SYS", "SYS", "SYS",
                                            "PIX", "NODE", "SYS", "SYS", "0-15", "0"]
    assert "NIC2: mlx5_2" in text


def test_not_supported_pair_stays_unknown_with_nvmls_words():
    found = discover_gpus(pcie8_nvml(levels={(0, 2): -L.NVML_ERROR_NOT_SUPPORTED}), sys_root=PCIE8)
    link = found.topology.link(0, 2)
    assert link.tier is None
    assert link.reason == "nvmlDeviceGetTopologyCommonAncestor: Not Supported (NVML_ERROR_NOT_SUPPORTED)"
    assert found.topology.link(0, 3).tier == "NODE"  # one failed pair does not spoil the others


def test_pcie_levels_map_to_labels():
    levels = {(0, 1): L.NVML_TOPOLOGY_INTERNAL, (0, 2): L.NVML_TOPOLOGY_SINGLE, (0, 3): L.NVML_TOPOLOGY_MULTIPLE,
              (1, 2): L.NVML_TOPOLOGY_HOSTBRIDGE, (1, 3): L.NVML_TOPOLOGY_NODE, (2, 3): L.NVML_TOPOLOGY_SYSTEM}
    devs = [Dev(bus(0x10 + i), other_links=L.NVML_ERROR_NOT_SUPPORTED) for i in range(4)]
    topo = discover_gpus(FakeNvml(devs, levels=levels)).topology
    assert {link.gpus: link.tier for link in topo.links} == {
        (0, 1): "PIX", (0, 2): "PIX", (0, 3): "PXB", (1, 2): "PHB", (1, 3): "NODE", (2, 3): "SYS"}


def test_unknown_numa_and_affinity_are_none_never_guessed():
    devs = [Dev(bus(0x10), numa=-1, fail={"nvmlDeviceGetCpuAffinity": L.NVML_ERROR_NOT_SUPPORTED}),
            Dev(bus(0x11), fail={"nvmlDeviceGetMemoryAffinity": L.NVML_ERROR_NOT_SUPPORTED})]
    found = discover_gpus(FakeNvml(devs), sys_root="/nonexistent")
    assert found.reason is None
    assert [(g.numa_node, g.cpu_affinity, g.pci_path) for g in found.gpus] == [
        (None, None, None), (None, "0-15", None)]


def test_numa_node_from_sysfs_when_nvml_has_no_memory_affinity(tmp_path):
    """PCIe boards answer nvmlDeviceGetNumaNodeId with NOT_SUPPORTED (an H200 did): the
    node nearest the GPU is its memory affinity, else the PCI device's numa_node."""
    for name, node in (("0000:10:00.0", "1"), ("0000:11:00.0", "-1")):
        device = tmp_path / "bus" / "pci" / "devices" / name
        device.mkdir(parents=True)
        (device / "numa_node").write_text(node + "\n")
    devs = [Dev(bus(0x10), numa=-1), Dev(bus(0x11), numa=-1), Dev(bus(0x12), numa=3)]
    found = discover_gpus(FakeNvml(devs), sys_root=tmp_path)
    assert [g.numa_node for g in found.gpus] == [1, None, 3]


def test_memory_affinity_over_several_nodes_is_no_single_node():
    class Spanning(FakeNvml):
        def nvmlDeviceGetMemoryAffinity(self, handle, nodeSetSize, scope):
            words = (ctypes.c_ulonglong * nodeSetSize)()
            words[0] = 0b11
            return words

    found = discover_gpus(Spanning([Dev(bus(0x10))]), sys_root="/nonexistent")
    assert found.gpus[0].numa_node is None and found.gpus[0].cpu_affinity == "0-15"


def test_nvswitch_pairs_count_links_into_common_switches():
    topo = discover_gpus(FakeNvml(hgx_a100())).topology
    assert {(link.tier, link.nvlinks) for link in topo.links} == {("NV", 12)}


def test_nvlink_counts_direct_and_one_sided():
    reports = [LinkReport(0, "A", ("B", "B", "S")), LinkReport(1, "B", ("A", "A", "S", "S")),
               LinkReport(2, "C", ("S",))]
    assert nvlink_counts(reports) == {(0, 1): 2, (0, 2): 1, (1, 2): 1}


def test_unknown_nvlink_marks_the_pcie_tier_as_partial():
    devs = [Dev(bus(0x10), other_links=L.NVML_ERROR_UNKNOWN), Dev(bus(0x11), other_links=L.NVML_ERROR_UNKNOWN)]
    found = discover_gpus(FakeNvml(devs))
    assert not found.nvlink_known
    (link,) = found.topology.links
    assert link.tier == "PHB" and "NVLink topology unknown" in link.reason


@pytest.mark.parametrize("a,b,expected", [
    # same switch: root bus, root port, upstream, then each its downstream port
    (("pci0000:16", "0000:16:02.0", "0000:17:00.0", "0000:18:00.0", "0000:19:00.0"),
     ("pci0000:16", "0000:16:02.0", "0000:17:00.0", "0000:18:01.0", "0000:1a:00.0"), "PIX"),
    # a switch below a switch
    (("pci0000:16", "0000:16:02.0", "0000:17:00.0", "0000:18:00.0", "0000:19:00.0"),
     ("pci0000:16", "0000:16:02.0", "0000:17:00.0", "0000:18:01.0", "0000:1a:00.0", "0000:1b:00.0",
      "0000:1c:00.0"), "PXB"),
    # two root ports of one root complex
    (("pci0000:16", "0000:16:02.0", "0000:17:00.0"), ("pci0000:16", "0000:16:03.0", "0000:18:00.0"), "PHB"),
])
def test_pci_tier_within_one_root_bus(a, b, expected):
    assert pci_tier(a, 0, b, 0) == expected


def test_pci_tier_across_root_buses_needs_numa():
    a, b = ("pci0000:16", "0000:16:02.0", "0000:17:00.0"), ("pci0000:3a", "0000:3a:02.0", "0000:3b:00.0")
    assert pci_tier(a, 0, b, 0) == "NODE"
    assert pci_tier(a, 0, b, 1) == "SYS"
    assert pci_tier(a, None, b, 1) is None
    assert pci_tier(None, 0, b, 0) is None


def test_adapters_are_located_from_their_class_links():
    hcas = {h.name: h for h in read_hcas(PCIE8 / "class" / "infiniband")}
    assert hcas["mlx5_0"].pci_bus_id == "0000:1b:00.0" and hcas["mlx5_0"].numa_node == 0
    assert hcas["mlx5_2"].numa_node == 1 and hcas["mlx5_2"].node_guid == "b83f:d203:0012:a510"
    gpus = {g.index: g for g in discover_gpus(pcie8_nvml(), sys_root=PCIE8).gpus}
    tier = {name: pci_tier(gpus[0].pci_path, gpus[0].numa_node, h.pci_path, h.numa_node) for name, h in hcas.items()}
    assert tier == {"mlx5_0": "PIX", "mlx5_1": "NODE", "mlx5_2": "SYS", "mlx5_3": "SYS"}


def test_cpulist():
    assert cpulist([0]) == ""
    assert cpulist([0b1011]) == "0-1,3"
    assert cpulist([0xFFFFFFFF, 0xFFFFFFFF]) == "0-31,64-95"


def test_discovered_inventory_is_a_valid_hardware_document_and_round_trips():
    inv = discover("n1", sysfs_root=PCIE8 / "class" / "infiniband", nvml=pcie8_nvml(
        levels={(0, 2): -L.NVML_ERROR_NOT_SUPPORTED}))
    assert inv.topology is not None and inv.gpus[0].pci_path is not None
    assert inv.hcas[0].pci_path is not None
    doc = inv.to_dict()
    assert schema_errors(doc, "hardware") == []
    assert HardwareInventory.from_dict(doc) == inv
