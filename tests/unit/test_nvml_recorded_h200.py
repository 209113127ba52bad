"""Discovery and GPU health over what a real driver answered (tests/fixtures/nvml/h200-pcie).

The fixture is a capture (tests/device/capture_nvml.py) from a machine with one
NVIDIA H200 on PCIe, driver 580.159.04, nvidia-ml-py 13.615.71: every NVML call
the agent made, with its answer or error code, and nvidia-smi's own view of the
same machine. Replaying it checks the agent against the driver rather than
against our reading of the headers, and against nvidia-smi, field by field.
"""

from __future__ import annotations

import json
import os
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pynvml
import pytest

from llmgw.hardware.gpu_health import NvmlHealth, sick_reasons
from llmgw.hardware.nvml import discover_gpus

ROOT = Path(__file__).resolve().parents[2]
CAPTURE = ROOT / "tests" / "fixtures" / "nvml" / "h200-pcie"
sys.path.insert(0, str(ROOT / "tests" / "device"))

from nvml_recording import ReplayNvml  # noqa: E402


def load(name: str):
    return json.loads((CAPTURE / name).read_text())


@pytest.fixture
def replay(monkeypatch) -> ReplayNvml:
    recording = load("nvml-recording.json")
    # The CPU mask is asked for in as many words as the machine had CPUs / 64.
    monkeypatch.setattr(os, "cpu_count", lambda: recording["about"]["os_cpu_count"])
    return ReplayNvml(recording, pynvml)


@pytest.fixture
def sysfs(tmp_path) -> Path:
    """The captured machine's PCI devices, as sysfs lays them out."""
    for bus, facts in load("sysfs.json")["gpus"].items():
        real = tmp_path / facts["resolved"].removeprefix("/sys/")
        real.mkdir(parents=True)
        (real / "numa_node").write_text(facts["numa_node"] + "\n")
        link = tmp_path / facts["sysfs"].removeprefix("/sys/")
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(real)
    return tmp_path


def smi_topology() -> dict[str, dict[str, str]]:
    """``nvidia-smi topo -m``'s matrix: row -> column -> cell."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", (CAPTURE / "nvidia-smi-topo.txt").read_text())
    lines = [line for line in text.splitlines() if line.strip()]
    # Columns are aligned with tabs, runs of them where a header is wide.
    header = [h.strip() for h in re.split(r"\t+", lines[0])[1:]]
    rows = {}
    for line in lines[1:]:
        if not line.startswith("GPU"):
            break
        cells = [c.strip() for c in re.split(r"\t+", line)]
        rows[cells[0]] = dict(zip(header, cells[1:]))
    return rows


def test_replayed_discovery_is_what_the_agent_found_on_the_driver(replay, sysfs):
    found = discover_gpus(replay, sys_root=sysfs)
    captured = load("discovery.json")
    assert found.reason is None and captured.get("gpu_reason") is None
    assert [g.to_dict() for g in found.gpus] == captured["gpus"]
    assert found.topology.to_dict() == captured["topology"]
    assert found.nvlink_known is captured["nvlink_known"] is True  # every link NOT_SUPPORTED: no NVLink, known


def test_discovery_agrees_with_nvidia_smi_on_the_same_machine(replay, sysfs):
    (gpu,) = discover_gpus(replay, sys_root=sysfs).gpus
    smi = ET.parse(CAPTURE / "nvidia-smi-q.xml").getroot().find("gpu")
    assert gpu.pci_bus_id == smi.get("id") == smi.findtext("pci/pci_bus_id")
    assert gpu.uuid == smi.findtext("uuid")
    assert gpu.name == smi.findtext("product_name")
    assert f"{gpu.memory_bytes // 2**20} MiB" == smi.findtext("fb_memory_usage/total")
    topo = smi_topology()["GPU0"]
    assert gpu.cpu_affinity == topo["CPU Affinity"]
    # nvidia-smi's "NUMA Affinity" is the node nearest the GPU; its "GPU NUMA ID" (N/A here) is
    # what nvmlDeviceGetNumaNodeId answers, NOT_SUPPORTED on this PCIe board.
    assert str(gpu.numa_node) == topo["NUMA Affinity"]
    assert topo["GPU NUMA ID"] == "N/A"
    assert gpu.pci_path == ("pci0000:00", "0000:00:06.0")


def test_gpu_health_on_the_driver_is_healthy_and_says_what_was_not_checked(replay, sysfs):
    health = NvmlHealth(replay)
    before = health.read()
    discover_gpus(replay, sys_root=sysfs)  # opens and closes NVML itself, as the agent's rediscovery does
    after = health.read()
    health.close()
    captured = load("health.json")
    assert {str(i): h.to_dict() for i, h in before.items()} == captured["before_discovery"]
    assert {str(i): h.to_dict() for i, h in after.items()} == captured["after_discovery"]
    (h,) = after.values()
    assert sick_reasons(h) == []
    assert h.ecc_uncorrected_volatile == 0 and h.remapped_rows_pending is False
    # Hopper retires no pages (it remaps rows): asked only where row remapping is not supported.
    assert "nvmlDeviceGetRetiredPagesPendingStatus" not in replay.made[:replay.made.index("nvmlShutdown")]
