"""Hardware inventory types: what a node has, as discovery saw it.

These are the boundary between discovery (NVML, sysfs, a simulated file) and
everything that consumes it (placement, the stream's `register` message, the
inventory plugin).  ``to_dict``/``from_dict`` produce and read exactly the
document that ``schemas/hardware.schema.json`` describes, so a simulated
hardware file and a real node's report are the same thing.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Any

from llmgw.hardware.gpu_health import GPUHealth
from llmgw.hardware.topology import Topology

# A control plane holds every node's inventory: at 10,000 8-GPU nodes the
# same few NVLink peer lists recur 80,000 times, so equal ones are shared.
_PEER_TUPLES: dict[tuple[int, ...], tuple[int, ...]] = {}


def _shared(peers: tuple[int, ...]) -> tuple[int, ...]:
    """One instance per distinct peer tuple (bounded: an 8-GPU box has a handful of patterns)."""
    if len(_PEER_TUPLES) > 4096:  # a fleet of odd topologies: stop sharing rather than grow
        return peers
    return _PEER_TUPLES.setdefault(peers, peers)


@dataclass(frozen=True)
class GPUProcess:
    """A process NVML lists as running on a GPU (compute or graphics context).

    ``pid`` is as NVML reports it: inside a container without the host's pid
    namespace it is a host pid, which may not exist (or be someone else) in
    the agent's own namespace.  ``used_memory_bytes`` is None when NVML cannot
    say (NVML_VALUE_NOT_AVAILABLE: some drivers, MIG, Windows WDDM).
    """

    pid: int
    used_memory_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "used_memory_bytes": self.used_memory_bytes}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GPUProcess":
        used = d.get("used_memory_bytes")
        return cls(pid=int(d["pid"]), used_memory_bytes=None if used is None else int(used))


@dataclass(frozen=True)
class GPU:
    index: int
    uuid: str
    name: str
    memory_bytes: int
    pci_bus_id: str
    # Indices (on this node) of GPUs that at least one active NVLink reaches.
    # Empty means "no NVLink seen", which is not the same as "topology unknown":
    # ``HardwareInventory.nvlink_known`` says which.
    nvlink_peers: tuple[int, ...] = ()
    # Processes using the GPU, as NVML listed them at discovery.  None means
    # "unknown" (the query failed, or a hardware file does not say), which is
    # not the same as () "NVML lists none".
    processes: tuple[GPUProcess, ...] | None = None
    # Where the GPU sits: its NUMA node and the CPUs close to it (kernel list
    # format, "0-31,64-95"), and its PCI path from the root bus (see
    # ``llmgw.hardware.topology.pci_tier``).  None: unknown, never guessed.
    numa_node: int | None = None
    cpu_affinity: str | None = None
    pci_path: tuple[str, ...] | None = None
    # Health as last read (``llmgw.hardware.gpu_health``); None: not read
    # (a hardware file without a ``health`` block, an older agent).
    health: GPUHealth | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "index": self.index,
            "uuid": self.uuid,
            "name": self.name,
            "memory_bytes": self.memory_bytes,
            "pci_bus_id": self.pci_bus_id,
            "nvlink_peers": list(self.nvlink_peers),
        }
        if self.processes is not None:
            d["processes"] = [p.to_dict() for p in self.processes]
        if self.numa_node is not None:
            d["numa_node"] = self.numa_node
        if self.cpu_affinity is not None:
            d["cpu_affinity"] = self.cpu_affinity
        if self.pci_path is not None:
            d["pci_path"] = list(self.pci_path)
        if self.health is not None:
            d["health"] = self.health.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GPU":
        return cls(
            index=int(d["index"]),
            uuid=str(d["uuid"]),
            name=sys.intern(str(d["name"])),
            memory_bytes=int(d["memory_bytes"]),
            pci_bus_id=str(d["pci_bus_id"]),
            nvlink_peers=_shared(tuple(sorted(int(p) for p in d.get("nvlink_peers", ())))),
            processes=None if d.get("processes") is None
            else tuple(GPUProcess.from_dict(p) for p in d["processes"]),
            numa_node=None if d.get("numa_node") is None else int(d["numa_node"]),
            cpu_affinity=d.get("cpu_affinity"),
            pci_path=None if d.get("pci_path") is None else tuple(str(x) for x in d["pci_path"]),
            health=None if d.get("health") is None else GPUHealth.from_dict(d["health"]),
        )


@dataclass(frozen=True)
class SickGPU:
    """A GPU the agent withholds because it is unfit (``llmgw.hardware.gpu_health``).

    The control plane replaces any replica with a shard on it: its engine
    cannot be trusted to serve.  ``since`` is when the agent first judged it
    so, for this reason (seconds since the epoch).
    """

    index: int
    reason: str
    since: float

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "reason": self.reason, "since": self.since}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SickGPU":
        return cls(index=int(d["index"]), reason=str(d["reason"]), since=float(d["since"]))


@dataclass(frozen=True)
class IBPort:
    """One port of an adapter, as /sys/class/infiniband/<hca>/ports/<n>/ shows it."""

    port: int
    state: str  # "ACTIVE", "INIT", "ARMED", "DOWN" (name part of "4: ACTIVE")
    phys_state: str  # "LinkUp", "Polling", "Disabled" ... (name part of "5: LinkUp")
    rate_gbps: float  # numeric part of "200 Gb/sec (4X HDR)"
    rate_text: str  # the whole rate line, for humans
    link_layer: str  # "InfiniBand" or "Ethernet" (RoCE)
    # Why a field could not be read or parsed (its value is then "UNKNOWN",
    # 0.0 or ""); None when every file read cleanly.
    reason: str | None = None
    # RoCE: the GID index NCCL_IB_GID_INDEX must name (RoCE v2, IPv4-mapped
    # first), from gids/ and gid_attrs/types/; None for InfiniBand or when none.
    gid_index: int | None = None

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "port": self.port,
            "state": self.state,
            "phys_state": self.phys_state,
            "rate_gbps": self.rate_gbps,
            "rate_text": self.rate_text,
            "link_layer": self.link_layer,
        }
        if self.reason is not None:
            d["reason"] = self.reason
        if self.gid_index is not None:
            d["gid_index"] = self.gid_index
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "IBPort":
        return cls(
            port=int(d["port"]),
            state=str(d["state"]),
            phys_state=str(d.get("phys_state", "")),
            rate_gbps=float(d.get("rate_gbps", 0.0)),
            rate_text=str(d.get("rate_text", "")),
            link_layer=str(d.get("link_layer", "InfiniBand")),
            reason=None if d.get("reason") is None else str(d["reason"]),
            gid_index=None if d.get("gid_index") is None else int(d["gid_index"]),
        )


@dataclass(frozen=True)
class HCA:
    name: str
    ports: tuple[IBPort, ...]
    # Where the adapter sits and who it is, from sysfs: the PCI device its
    # class entry links into, that device's path from the root bus and NUMA
    # node, and node_guid.  None: unknown.
    pci_bus_id: str | None = None
    pci_path: tuple[str, ...] | None = None
    numa_node: int | None = None
    node_guid: str | None = None

    @property
    def active_ports(self) -> tuple[IBPort, ...]:
        return tuple(p for p in self.ports if p.active)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "ports": [p.to_dict() for p in self.ports]}
        for key in ("pci_bus_id", "numa_node", "node_guid"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        if self.pci_path is not None:
            d["pci_path"] = list(self.pci_path)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "HCA":
        return cls(
            name=str(d["name"]),
            ports=tuple(IBPort.from_dict(p) for p in d.get("ports", ())),
            pci_bus_id=d.get("pci_bus_id"),
            pci_path=None if d.get("pci_path") is None else tuple(str(x) for x in d["pci_path"]),
            numa_node=None if d.get("numa_node") is None else int(d["numa_node"]),
            node_guid=d.get("node_guid"),
        )


@dataclass(frozen=True)
class FabricDeclaration:
    """A fabric as the operator declared it for one node (agent.yaml).

    ``hcas`` are adapter names or single ports (``mlx5_0:1``); ``link_layer``
    fixes the fabric's kind (else the first usable port's); ``identities``
    are the adapters' node GUID / PCI address as recorded at rollout.
    """

    name: str
    hcas: tuple[str, ...]
    min_rate_gbps: float | None = None
    link_layer: str | None = None
    identities: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()

    def to_rules(self) -> dict[str, Any]:
        """The plain dict ``fabric_rules.check_fabric`` takes."""
        return {"name": self.name, "hcas": list(self.hcas), "min_rate_gbps": self.min_rate_gbps,
                "link_layer": self.link_layer, "identities": {n: dict(kv) for n, kv in self.identities}}


@dataclass(frozen=True)
class FabricStatus:
    """A declared fabric after comparing it with what the node really has.

    ``advertised_hcas`` holds only adapters that are present with an ACTIVE
    port; ``problems`` says, naming each adapter, why the others are not.
    """

    name: str
    declared_hcas: tuple[str, ...]
    advertised_hcas: tuple[str, ...]  # as NCCL_IB_HCA names them: mlx5_0, or mlx5_0:1 for one port
    rate_gbps: float | None  # slowest usable link; None when none, or when any one's rate is unknown
    problems: tuple[str, ...] = ()
    link_layer: str | None = None  # "InfiniBand" or "Ethernet" (RoCE): one per fabric
    gid_index: int | None = None  # RoCE: NCCL_IB_GID_INDEX for every advertised port
    rate_at_most_gbps: float | None = None  # when the rate is unknown: the slowest known link

    def adapter_names(self) -> tuple[str, ...]:
        """The adapters behind ``advertised_hcas`` (``mlx5_0:1`` -> ``mlx5_0``)."""
        return tuple(dict.fromkeys(h.split(":", 1)[0] for h in self.advertised_hcas))

    @property
    def usable(self) -> bool:
        return bool(self.advertised_hcas)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "declared_hcas": list(self.declared_hcas),
            "advertised_hcas": list(self.advertised_hcas),
            "rate_gbps": self.rate_gbps,
            "problems": list(self.problems),
        }
        for key in ("link_layer", "gid_index", "rate_at_most_gbps"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FabricStatus":
        rate = d.get("rate_gbps")
        at_most = d.get("rate_at_most_gbps")
        return cls(
            name=str(d["name"]),
            declared_hcas=tuple(d.get("declared_hcas", ())),
            advertised_hcas=tuple(d.get("advertised_hcas", ())),
            rate_gbps=None if rate is None else float(rate),
            problems=tuple(d.get("problems", ())),
            link_layer=d.get("link_layer"),
            gid_index=None if d.get("gid_index") is None else int(d["gid_index"]),
            rate_at_most_gbps=None if at_most is None else float(at_most),
        )


@dataclass(frozen=True)
class HardwareInventory:
    node_id: str
    gpus: tuple[GPU, ...]
    hcas: tuple[HCA, ...] = ()
    fabrics: tuple[FabricStatus, ...] = ()
    # Discovered adapters that no declared fabric names: reported, never used.
    undeclared_hcas: tuple[str, ...] = ()
    gpu_source: str = "nvml"  # "nvml" | "simulated"
    # Why there are 0 GPUs, when there are; or, in what an agent advertises,
    # which GPUs it withholds and why (held by a process that is not its own).
    gpu_reason: str | None = None
    nvlink_known: bool = True  # False when topology could not be read
    # Every GPU pair's tier (NVLink, PCIe, NUMA); None when not discovered
    # (an older agent, a file that does not say): tiers then unknown.
    topology: Topology | None = None
    # GPUs withheld as unfit, each with why; what is advertised leaves them
    # out of ``gpus``, and the control plane moves replicas off them.
    sick_gpus: tuple[SickGPU, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    def gpu(self, index: int) -> GPU:
        for g in self.gpus:
            if g.index == index:
                return g
        raise KeyError(index)

    def without_gpus(self, held: set[int], parts: list[str] | tuple[str, ...]) -> "HardwareInventory":
        """This inventory less the GPUs ``held`` (and peers pointing at them), ``parts`` added to
        ``gpu_reason``: what a node advertises when some of its GPUs are not free to give."""
        reason = "; ".join(parts)
        if self.gpu_reason:
            reason = f"{self.gpu_reason}; {reason}"
        gpus = tuple(dataclasses.replace(g, nvlink_peers=tuple(p for p in g.nvlink_peers if p not in held))
                     for g in self.gpus if g.index not in held)
        return dataclasses.replace(self, gpus=gpus, gpu_reason=reason)

    def fabric(self, name: str) -> FabricStatus | None:
        for f in self.fabrics:
            if f.name == name:
                return f
        return None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "node_id": self.node_id,
            "gpu_source": self.gpu_source,
            "gpus": [g.to_dict() for g in self.gpus],
            "nvlink_known": self.nvlink_known,
            "hcas": [h.to_dict() for h in self.hcas],
            "fabrics": [f.to_dict() for f in self.fabrics],
            "undeclared_hcas": list(self.undeclared_hcas),
        }
        if self.gpu_reason is not None:
            d["gpu_reason"] = self.gpu_reason
        if self.topology is not None:
            d["topology"] = self.topology.to_dict()
        if self.sick_gpus:
            d["sick_gpus"] = [g.to_dict() for g in self.sick_gpus]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "HardwareInventory":
        return cls(
            node_id=str(d["node_id"]),
            gpus=tuple(GPU.from_dict(g) for g in d.get("gpus", ())),
            hcas=tuple(HCA.from_dict(h) for h in d.get("hcas", ())),
            fabrics=tuple(FabricStatus.from_dict(f) for f in d.get("fabrics", ())),
            undeclared_hcas=tuple(d.get("undeclared_hcas", ())),
            gpu_source=str(d.get("gpu_source", "simulated")),
            gpu_reason=d.get("gpu_reason"),
            nvlink_known=bool(d.get("nvlink_known", True)),
            topology=None if d.get("topology") is None else Topology.from_dict(d["topology"]),
            sick_gpus=tuple(SickGPU.from_dict(g) for g in d.get("sick_gpus", ())),
        )
