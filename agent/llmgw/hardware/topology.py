"""How GPUs (and adapters) on one node are connected: the tiers of ``nvidia-smi topo -m``.

A tensor-parallel group all-reduces on every layer, and the slowest pair of
GPUs sets its pace; between two GPUs that pace differs several times over
depending on the path: an NVLink, one PCIe switch, a chain of switches, the
host bridge, the CPU's internal fabric within one NUMA node, or the link
between sockets.  The tiers, best first, spelled as ``nvidia-smi topo -m``
spells them:

========  ==================================================================
``NV``    NVLink (``NV4``: four links), direct or through an NVSwitch
``PIX``   at most one PCIe bridge (the same PCIe switch)
``PXB``   several PCIe bridges, no host bridge (a tree of switches)
``PHB``   a PCIe host bridge (the same root complex)
``NODE``  between host bridges within one NUMA node
``SYS``   across NUMA nodes (the socket interconnect, QPI/UPI/xGMI)
========  ==================================================================

NVML gives the PCIe tier of a GPU pair (``nvmlDeviceGetTopologyCommonAncestor``,
``NVML_TOPOLOGY_*``).  For a GPU and an RDMA adapter the tier comes from their
PCI paths in sysfs (``pci_tier``): the same root complex and switch tree NVML
walks.  A tier that cannot be read is ``None`` ("unknown"), with the reason,
never a guess: placement ranks unknown below ``SYS``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

TIERS = ("NV", "PIX", "PXB", "PHB", "NODE", "SYS")
# Lower is closer.  Unknown ranks below every known tier.
TIER_RANK = {t: i for i, t in enumerate(TIERS)}
UNKNOWN_RANK = len(TIERS)

TIER_WORDS = {
    "NV": "NVLink",
    "PIX": "one PCIe switch",
    "PXB": "several PCIe switches",
    "PHB": "a PCIe host bridge",
    "NODE": "host bridges within one NUMA node",
    "SYS": "the link between NUMA nodes (sockets)",
    None: "an unknown path",
}

# NVML_TOPOLOGY_* levels (nvml.h nvmlGpuTopologyLevel_t) -> nvidia-smi's label.
# INTERNAL is two GPUs on one board (K80, GRID K2): behind the board's own switch.
NVML_LEVELS = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


def rank(tier: str | None) -> int:
    return UNKNOWN_RANK if tier is None else TIER_RANK[tier]


def label(tier: str | None, nvlinks: int = 0) -> str:
    """``NV4``, ``PIX`` ... as in ``nvidia-smi topo -m``; ``?`` when unknown."""
    if tier is None:
        return "?"
    if tier == "NV" and nvlinks:
        return f"NV{nvlinks}"
    return tier


@dataclass(frozen=True)
class GPULink:
    """The path between two GPUs of a node (``gpus`` ascending)."""

    gpus: tuple[int, int]
    tier: str | None  # one of TIERS; None when unknown
    nvlinks: int = 0  # active NVLinks between them (direct, or through a common NVSwitch)
    reason: str | None = None  # why the tier is unknown

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"gpus": list(self.gpus), "tier": self.tier}
        if self.nvlinks:
            d["nvlinks"] = self.nvlinks
        if self.reason is not None:
            d["reason"] = self.reason
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GPULink":
        a, b = (int(x) for x in d["gpus"])
        tier = d.get("tier")
        return cls(gpus=(min(a, b), max(a, b)), tier=None if tier is None else str(tier),
                   nvlinks=int(d.get("nvlinks", 0)), reason=d.get("reason"))


@dataclass(frozen=True)
class Topology:
    """Every GPU pair's tier; a pair not listed is unknown."""

    links: tuple[GPULink, ...]

    def link(self, a: int, b: int) -> GPULink | None:
        key = (min(a, b), max(a, b))
        for link in self.links:
            if link.gpus == key:
                return link
        return None

    def as_map(self) -> dict[tuple[int, int], GPULink]:
        return {link.gpus: link for link in self.links}

    def to_dict(self) -> dict[str, Any]:
        return {"links": [link.to_dict() for link in self.links]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Topology":
        return cls(links=tuple(sorted((GPULink.from_dict(x) for x in d.get("links", ())), key=lambda l: l.gpus)))


def pci_tier(path_a: Sequence[str] | None, numa_a: int | None,
             path_b: Sequence[str] | None, numa_b: int | None) -> str | None:
    """The tier between two PCI devices from their sysfs paths, or None if unknown.

    A path runs from the root bus to the device, as ``/sys/devices`` nests
    them: ``("pci0000:16", "0000:16:02.0", "0000:17:00.0", "0000:18:00.0",
    "0000:19:00.0")`` is root bus, root port, switch upstream port, switch
    downstream port, device.  Different root buses: NODE within one NUMA node,
    SYS across (unknown when a NUMA node is).  The same root bus: PHB when
    only the root bus is shared; PIX when both sit directly below one switch
    (at most one bridge below what they share besides the root port); PXB
    for deeper trees.
    """
    if not path_a or not path_b:
        return None
    if path_a[0] != path_b[0]:
        if numa_a is None or numa_b is None or numa_a < 0 or numa_b < 0:
            return None
        return "NODE" if numa_a == numa_b else "SYS"
    bridges_a, bridges_b = list(path_a[1:-1]), list(path_b[1:-1])
    common = 0
    for x, y in zip(bridges_a, bridges_b):
        if x != y:
            break
        common += 1
    if common == 0:
        return "PHB"
    below_a, below_b = len(bridges_a) - common, len(bridges_b) - common
    if common >= 2 and below_a <= 1 and below_b <= 1:
        return "PIX"
    if common == 1 and below_a == 0 and below_b == 0:
        return "PIX"  # two functions of one device behind a root port
    return "PXB"


def cpulist(words: Iterable[int], bits: int = 64) -> str:
    """A CPU mask (NVML's array of 64-bit words, lowest CPUs first) as the
    kernel's list format, ``"0-31,64-95"``; empty when no bit is set."""
    cpus = [w * bits + b for w, word in enumerate(words) for b in range(bits) if int(word) >> b & 1]
    parts: list[str] = []
    start = prev = None
    for c in cpus:
        if prev is not None and c == prev + 1:
            prev = c
            continue
        if start is not None:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        start = prev = c
    if start is not None:
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(parts)
