"""GPUs and their NVLink topology from NVML (the ``pynvml`` bindings).

NVML is the only source of NVLink topology, and the topology decides whether
a tensor-parallel group is fast: on a PCIe box where bridges pair specific
cards, a group straddling two bridges runs several times slower and nothing
else says so.  Hence ``nvlink_known``: "no NVLink seen" and "could not look"
must stay different answers.

Peers are derived from what each active link's remote PCI id says, nothing
more:

* remote id == another local GPU's bus id: a direct link (a bridge, or a
  board without switches); the two GPUs are peers.
* remote id that is not a local GPU: an NVSwitch (on HGX A100, for example,
  every GPU has links to each of six switches, seen as ``00000008:00:00.0``
  and so on).  The id is recorded, and all GPUs that reach the *same* switch
  id are peers of each other, since the switch forwards between any of its
  ports.  Full connectivity is never assumed from the mere presence of a
  switch link: two GPUs are peers only if they reach a common id.
* a remote id that cannot be parsed is ignored for peers and marks the
  topology as not known.

Peering is symmetric: a link seen from one end joins both GPUs.

Per link, NVML_ERROR_NOT_SUPPORTED / INVALID_ARGUMENT / NOT_FOUND mean "no
NVLink on this link" (devices answer so for links they do not have; we probe
all ``NVML_NVLINK_MAX_LINKS``) and leave the topology known.
NVML_ERROR_FUNCTION_NOT_FOUND means the driver's NVML has no NVLink calls:
the GPU is treated as having no NVLink, but the topology is then *unknown*.
Any other NVML error on a link also makes the topology unknown.

Processes using each GPU (``GPU.processes``) come from
``nvmlDeviceGetComputeRunningProcesses`` and
``nvmlDeviceGetGraphicsRunningProcesses``, the newest version the bindings
and the driver both have (``_v3``, then ``_v2``, then the unversioned name
older bindings have); a pid in both lists is listed once.  A used-memory
value NVML cannot give (None, or NVML_VALUE_NOT_AVAILABLE where older
bindings pass it through) becomes None.  A failed query is logged and leaves
that GPU's list None ("unknown"), never failing discovery; a device without
graphics process accounting (NOT_SUPPORTED) simply has no graphics entries.
Inside a container NVML reports the driver's (host) pids, which may not
exist in this process's pid namespace.

Without NVML (library missing, driver not loaded, init failing for any
reason) discovery returns no GPUs and a reason, logs "0 GPUs: <reason>" once
per process per reason at WARNING, and never raises: a node without GPUs
still registers, so the operator sees why from the control plane.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

from llmgw.hardware.topology import NVML_LEVELS, GPULink, Topology, cpulist
from llmgw.hardware.types import GPU, GPUProcess

log = logging.getLogger(__name__)

_BUS_ID = re.compile(
    r"^\s*(?:(?P<domain>[0-9A-Fa-f]{1,8}):)?(?P<bus>[0-9A-Fa-f]{1,2}):"
    r"(?P<device>[0-9A-Fa-f]{1,2})\.(?P<function>[0-7])\s*$"
)


def normalize_bus_id(value: str | bytes | None) -> str | None:
    """NVML's canonical ``"00000000:1B:00.0"`` for any spelling of a PCI id
    (4- or 8-digit domain, either case, bytes or str); None if unparseable.

    NVML has used both the legacy ``"0000:1B:00.0"`` and the 8-digit domain
    form over the years, and the remote end of an NVLink may be reported in
    either, so ids are only ever compared in this form.
    """
    text = _text(value)
    m = _BUS_ID.match(text.rstrip("\x00"))
    if not m:
        return None
    domain = int(m.group("domain") or "0", 16)
    return "%08X:%02X:%02X.%X" % (
        domain,
        int(m.group("bus"), 16),
        int(m.group("device"), 16),
        int(m.group("function")),
    )


def _text(value: Any) -> str:
    """pynvml returns str from current bindings and bytes from older ones."""
    if value is None:
        return ""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).split(b"\x00", 1)[0].decode("utf-8", errors="replace")
    return str(value)


# --- pure topology ----------------------------------------------------------


@dataclass(frozen=True)
class LinkReport:
    """What one GPU's active links reach, as read from NVML."""

    index: int
    bus_id: str
    remote_bus_ids: tuple[str | None, ...]  # one per active link; None = unparseable


def nvlink_peers(
    reports: list[LinkReport], unusable_bus_ids: frozenset[str] = frozenset()
) -> tuple[dict[int, tuple[int, ...]], bool]:
    """Peer indices per GPU from each GPU's active links (rules in the module
    docstring), and whether every remote id could be interpreted.

    ``unusable_bus_ids`` are GPUs of this node that are left out of the
    inventory: a link to one is neither a peer nor a switch, or GPUs that
    each reach it would wrongly become peers of each other.
    """
    by_bus = {r.bus_id: r.index for r in reports}
    peers: dict[int, set[int]] = {r.index: set() for r in reports}
    switches: dict[str, set[int]] = defaultdict(set)
    known = True
    for r in reports:
        for remote in r.remote_bus_ids:
            if remote is None:
                known = False
                continue
            if remote in unusable_bus_ids:
                continue
            other = by_bus.get(remote)
            if other is None:
                switches[remote].add(r.index)
            elif other != r.index:
                peers[r.index].add(other)
                peers[other].add(r.index)
    for members in switches.values():
        for i in members:
            peers[i].update(m for m in members if m != i)
    return {i: tuple(sorted(p)) for i, p in peers.items()}, known


def nvlink_counts(reports: list[LinkReport], unusable_bus_ids: frozenset[str] = frozenset()) -> dict[tuple[int, int], int]:
    """Active NVLinks per GPU pair, as ``nvidia-smi topo -m`` counts them (``NV4``).

    A direct pair counts the links between them (seen from the lower index:
    both ends report the same links).  A pair joined through NVSwitches
    counts, on each side, its links into switches both reach, and takes the
    smaller side: traffic between them cannot use more.
    """
    by_bus = {r.bus_id: r.index for r in reports}
    direct: dict[tuple[int, int], int] = defaultdict(int)
    into: dict[int, dict[str, int]] = {r.index: defaultdict(int) for r in reports}
    for r in reports:
        for remote in r.remote_bus_ids:
            if remote is None or remote in unusable_bus_ids:
                continue
            other = by_bus.get(remote)
            if other is None:
                into[r.index][remote] += 1
            elif other != r.index:
                key = (min(r.index, other), max(r.index, other))
                if r.index == key[0]:
                    direct[key] += 1
    counts = dict(direct)
    indices = sorted(into)
    for i, a in enumerate(indices):
        for b in indices[i + 1:]:
            shared = set(into[a]) & set(into[b])
            if shared:
                via = min(sum(into[a][s] for s in shared), sum(into[b][s] for s in shared))
                counts[(a, b)] = max(counts.get((a, b), 0), via)
    return counts


# --- NVML I/O ---------------------------------------------------------------


class NvmlDiscovery(NamedTuple):
    gpus: tuple[GPU, ...]
    reason: str | None  # why there are no GPUs, when there are none
    nvlink_known: bool
    topology: Topology | None = None  # every pair's tier; None when there are no GPUs


_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn_zero(reason: str) -> None:
    with _warned_lock:
        if reason in _warned:
            return
        _warned.add(reason)
    log.warning("0 GPUs: %s", reason)


def _reset_warnings() -> None:
    """Forget which reasons were logged (for tests)."""
    with _warned_lock:
        _warned.clear()


def _code(nvml: Any, err: BaseException) -> int | None:
    return getattr(err, "value", None) if isinstance(err, nvml.NVMLError) else None


def _init_reason(nvml: Any, err: BaseException) -> str:
    code = _code(nvml, err)
    if code == nvml.NVML_ERROR_LIBRARY_NOT_FOUND:
        return "NVML library (libnvidia-ml.so.1) not found: is the NVIDIA driver installed?"
    if code == nvml.NVML_ERROR_DRIVER_NOT_LOADED:
        return "NVIDIA driver not loaded (nvmlInit: Driver Not Loaded)"
    if code is not None:
        return f"nvmlInit failed: {err} ({type(err).__name__})"
    return f"nvmlInit failed: {type(err).__name__}: {err}"


def _no_link_codes(nvml: Any) -> frozenset[int]:
    return frozenset(
        c
        for c in (
            getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", None),
            getattr(nvml, "NVML_ERROR_INVALID_ARGUMENT", None),
            getattr(nvml, "NVML_ERROR_NOT_FOUND", None),
        )
        if c is not None
    )


def _active_remote_ids(nvml: Any, handle: Any, index: int) -> tuple[tuple[str | None, ...], bool]:
    """Remote PCI ids of the device's active links, and whether every link answered."""
    no_link = _no_link_codes(nvml)
    remotes: list[str | None] = []
    errors: list[str] = []
    for link in range(int(nvml.NVML_NVLINK_MAX_LINKS)):
        try:
            if nvml.nvmlDeviceGetNvLinkState(handle, link) != nvml.NVML_FEATURE_ENABLED:
                continue
            pci = nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)
        except nvml.NVMLError as e:
            code = _code(nvml, e)
            if code in no_link:
                continue
            if code == nvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                log.warning("GPU %d: this NVML has no NVLink queries (%s); NVLink topology unknown", index, e)
                return tuple(remotes), False
            errors.append(f"link {link}: {e}")
            continue
        raw = getattr(pci, "busId", None)
        remote = normalize_bus_id(raw)
        if remote is None:
            errors.append(f"link {link}: unparseable remote PCI id {_text(raw)!r}")
        remotes.append(remote)
    if errors:
        log.warning("GPU %d: NVLink topology unknown: %s", index, "; ".join(errors))
    return tuple(remotes), not errors


_NOT_AVAILABLE = (1 << 64) - 1  # NVML_VALUE_NOT_AVAILABLE_ulonglong as an unsigned value


class _NoQuery(Exception):
    """Neither the bindings nor the driver have any version of a process query."""


def _running_processes(nvml: Any, handle: Any, kind: str) -> list[Any]:
    """``nvmlDeviceGet<kind>RunningProcesses``, newest version both ends have.

    A version the bindings lack is skipped; one the driver lacks answers
    NVML_ERROR_FUNCTION_NOT_FOUND (or, through the unversioned wrapper of
    current bindings, ``NVMLLibraryMismatchError``) and the next is tried.
    Any other NVML error propagates.
    """
    base = f"nvmlDeviceGet{kind}RunningProcesses"
    mismatch = getattr(nvml, "NVMLLibraryMismatchError", None)
    missing: list[str] = []
    for name in (f"{base}_v3", f"{base}_v2", base):
        fn = getattr(nvml, name, None)
        if fn is None:
            continue
        try:
            return list(fn(handle))
        except nvml.NVMLError as e:
            if _code(nvml, e) != nvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                raise
            missing.append(f"{name}: {e}")
        except Exception as e:  # noqa: BLE001 - only the bindings' version mismatch is expected here
            if mismatch is None or not isinstance(e, mismatch):
                raise
            missing.append(f"{name}: {e}")
    raise _NoQuery("; ".join(missing) or f"the NVML bindings have no {base}")


def _used_memory(value: Any) -> int | None:
    if value is None:
        return None
    try:
        used = int(value)
    except (TypeError, ValueError):
        return None
    return None if used < 0 or used >= _NOT_AVAILABLE else used


def gpu_processes(nvml: Any, handle: Any, index: int) -> tuple[GPUProcess, ...] | None:
    """Processes with a compute or graphics context on the GPU; None when NVML cannot tell.

    Never raises: an error is logged (WARNING, naming the GPU) and means
    "unknown".  Graphics answering NOT_SUPPORTED or missing altogether adds
    nothing; the compute list alone is then the answer.
    """
    found: dict[int, int | None] = {}
    for kind in ("Compute", "Graphics"):
        try:
            procs = _running_processes(nvml, handle, kind)
        except _NoQuery as e:
            if kind == "Compute":
                log.warning("GPU %d: processes unknown: this NVML has no compute process query (%s)", index, e)
                return None
            continue
        except Exception as e:  # noqa: BLE001 - a failed query means "unknown", never a failed discovery
            if kind == "Graphics" and _code(nvml, e) == getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", None):
                continue
            log.warning("GPU %d: processes unknown: nvmlDeviceGet%sRunningProcesses failed: %s (%s)",
                        index, kind, e, type(e).__name__)
            return None
        for p in procs:
            try:
                pid = int(p.pid)
            except (AttributeError, TypeError, ValueError) as e:
                log.warning("GPU %d: processes unknown: NVML returned an unreadable process entry %r (%s)",
                            index, p, e)
                return None
            used = _used_memory(getattr(p, "usedGpuMemory", None))
            if pid in found and found[pid] is not None:
                # Both lists name it: keep the larger figure (each is the process's total on this GPU).
                used = found[pid] if used is None else max(used, found[pid])  # type: ignore[type-var]
            found[pid] = used
    return tuple(GPUProcess(pid, used) for pid, used in sorted(found.items()))


def error_name(nvml: Any, err: BaseException) -> str:
    """``"Not Supported (NVML_ERROR_NOT_SUPPORTED)"``: the bindings' text and the constant's name."""
    code = _code(nvml, err)
    # The constants live in the bindings' module (the one defining the error class).
    module = sys.modules.get(type(err).__module__, nvml)
    names = [n for n in dir(module) if n.startswith("NVML_ERROR_") and getattr(module, n, None) == code]
    return f"{err} ({names[0]})" if code is not None and names else f"{err} ({type(err).__name__})"


def pair_topology(nvml: Any, handles: list[tuple[int, Any]],
                  nvlinks: dict[tuple[int, int], int], nvlink_known: bool) -> Topology:
    """Every pair's tier: NVLink when links join them, else the PCIe/NUMA level
    ``nvmlDeviceGetTopologyCommonAncestor`` gives.  An error (NOT_SUPPORTED on
    some boards) leaves the pair unknown with NVML's words, never guessed."""
    links = []
    for i, (a, ha) in enumerate(handles):
        for b, hb in handles[i + 1:]:
            key = (min(a, b), max(a, b))
            count = nvlinks.get(key, 0)
            if count:
                links.append(GPULink(key, "NV", count))
                continue
            try:
                level = int(nvml.nvmlDeviceGetTopologyCommonAncestor(ha, hb))
            except nvml.NVMLError as e:
                links.append(GPULink(key, None, reason=f"nvmlDeviceGetTopologyCommonAncestor: {error_name(nvml, e)}"))
                continue
            tier = NVML_LEVELS.get(level)
            if tier is None:
                links.append(GPULink(key, None, reason=f"nvmlDeviceGetTopologyCommonAncestor: unknown level {level}"))
                continue
            if not nvlink_known:
                # NVLink could not be read: the PCIe tier is true, but a link may be hidden.
                links.append(GPULink(key, tier, reason="NVLink topology unknown: this is the PCIe tier"))
                continue
            links.append(GPULink(key, tier))
    return Topology(tuple(links))


# Node sets are asked for in this many 64-bit words: room for 256 NUMA nodes.
_NODE_SET_WORDS = 4


def _set_bits(words: Any, bits: int = 64) -> list[int]:
    return [w * bits + b for w, word in enumerate(words) for b in range(bits) if int(word) >> b & 1]


def _sysfs_numa_node(bus_id: str | None, sys_root: str | Path) -> int | None:
    device = _sysfs_device(bus_id, sys_root)
    if device is None:
        return None
    try:
        value = int((device / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return value if value >= 0 else None


def gpu_locality(nvml: Any, handle: Any, index: int, bus_id: str | None = None,
                 sys_root: str | Path = "/sys") -> tuple[int | None, str | None]:
    """The NUMA node nearest the GPU and its CPU affinity; None for what cannot be said.

    The node is what ``nvidia-smi topo -m`` shows as "NUMA Affinity": the CPU
    side's node, which is what an adapter's sysfs ``numa_node`` is compared
    with.  It comes from ``nvmlDeviceGetMemoryAffinity`` at node scope (one
    node set; several mean no single answer), else from sysfs.  Not from
    ``nvmlDeviceGetNumaNodeId``: that is the GPU's *own* node where GPU memory
    is a NUMA node (Grace Hopper), and PCIe boards answer NOT_SUPPORTED (seen
    on an H200, whose "NUMA Affinity" nvidia-smi gave as 0 on the same machine).
    """
    numa: int | None = None
    fn = getattr(nvml, "nvmlDeviceGetMemoryAffinity", None)
    scope = getattr(nvml, "NVML_AFFINITY_SCOPE_NODE", None)
    if fn is not None and scope is not None:
        try:
            nodes = _set_bits(fn(handle, _NODE_SET_WORDS, scope))
        except nvml.NVMLError as e:
            log.info("GPU %d: nvmlDeviceGetMemoryAffinity: %s; trying sysfs", index, error_name(nvml, e))
        else:
            if len(nodes) == 1:
                numa = nodes[0]
            elif nodes:
                log.info("GPU %d: memory affinity spans NUMA nodes %s; no single node", index, nodes)
                return None, _cpu_affinity(nvml, handle, index)
    if numa is None:
        numa = _sysfs_numa_node(bus_id, sys_root)
        if numa is None:
            log.info("GPU %d: NUMA node unknown (neither NVML's memory affinity nor sysfs numa_node says)", index)
    return numa, _cpu_affinity(nvml, handle, index)


def _cpu_affinity(nvml: Any, handle: Any, index: int) -> str | None:
    words = max(1, -(-(os.cpu_count() or 64) // 64))
    try:
        return cpulist(nvml.nvmlDeviceGetCpuAffinity(handle, words)) or None
    except nvml.NVMLError as e:
        log.info("GPU %d: CPU affinity unknown: nvmlDeviceGetCpuAffinity: %s", index, error_name(nvml, e))
        return None


def _sysfs_device(bus_id: str | None, sys_root: str | Path) -> Path | None:
    """``<sys>/bus/pci/devices/<id>`` for an NVML bus id; None if unparseable."""
    norm = normalize_bus_id(bus_id)
    if norm is None:
        return None
    domain, rest = norm.split(":", 1)
    return Path(sys_root) / "bus" / "pci" / "devices" / f"{int(domain, 16):04x}:{rest.lower()}"


def sysfs_pci_path(bus_id: str, sys_root: str | Path = "/sys") -> tuple[str, ...] | None:
    """The device's path from its root bus, from ``/sys/bus/pci/devices/<id>``
    (a symlink into ``/sys/devices``); None when it cannot be resolved."""
    link = _sysfs_device(bus_id, sys_root)
    if link is None:
        return None
    try:
        target = link.resolve(strict=True)
    except OSError:
        return None
    parts = target.parts
    for i, part in enumerate(parts):
        if part.startswith("pci") and ":" in part:
            return tuple(parts[i:])
    return None


def _load_default_nvml() -> ModuleType:
    import pynvml

    return pynvml


def discover_gpus(nvml: Any = None, sys_root: str | Path = "/sys") -> NvmlDiscovery:
    """Every GPU NVML sees, with NVLink peers; never raises.

    ``nvml`` is the bindings module (default: the real ``pynvml``); anything
    with the same functions, constants and exception classes will do, which
    is how this is tested on machines without a GPU.
    """
    if nvml is None:
        try:
            nvml = _load_default_nvml()
        except ImportError as e:
            return _zero(f"pynvml is not installed ({e})")
    try:
        nvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - any init failure means "no GPUs, and why"
        return _zero(_init_reason(nvml, e))
    try:
        return _discover_initialised(nvml, sys_root)
    except Exception as e:  # noqa: BLE001 - a broken driver must not take the agent down
        return _zero(f"NVML query failed: {type(e).__name__}: {e}")
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception as e:  # noqa: BLE001
            log.debug("nvmlShutdown: %s", e)


def _discover_initialised(nvml: Any, sys_root: str | Path = "/sys") -> NvmlDiscovery:
    count = int(nvml.nvmlDeviceGetCount())
    found: list[tuple[int, str, str, int, str, Any]] = []
    failures: list[str] = []
    unusable: set[str] = set()
    for index in range(count):
        bus: str | None = None
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            raw_bus = nvml.nvmlDeviceGetPciInfo(handle).busId
            bus = normalize_bus_id(raw_bus) or _text(raw_bus).strip()
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            name = _text(nvml.nvmlDeviceGetName(handle))
            memory = int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
        except nvml.NVMLError as e:
            # One GPU NVML cannot describe (lost, no permission) is left out;
            # the others are still usable.
            log.warning("GPU %d: left out, NVML cannot describe it: %s (%s)", index, e, type(e).__name__)
            failures.append(f"GPU {index}: {e}")
            if bus:
                unusable.add(bus)
            continue
        found.append((index, uuid, name, memory, bus, handle))
    if not found:
        if count == 0:
            return _zero("NVML sees no GPUs", nvlink_known=True)
        return _zero(f"NVML sees {count} GPU(s) but can describe none: " + "; ".join(failures),
                     nvlink_known=False)

    reports = []
    # A GPU left out may carry links between the others we cannot see.
    known = not failures
    for index, _uuid, _name, _mem, bus, handle in found:
        remotes, link_known = _active_remote_ids(nvml, handle, index)
        known = known and link_known
        reports.append(LinkReport(index=index, bus_id=bus, remote_bus_ids=remotes))
    peers, ids_known = nvlink_peers(reports, frozenset(unusable))
    counts = nvlink_counts(reports, frozenset(unusable))
    topology = pair_topology(nvml, [(f[0], f[5]) for f in found], counts, known and ids_known)
    gpus = []
    for index, uuid, name, mem, bus, handle in found:
        numa, affinity = gpu_locality(nvml, handle, index, bus, sys_root)
        gpus.append(GPU(index=index, uuid=uuid, name=name, memory_bytes=mem, pci_bus_id=bus,
                        nvlink_peers=peers[index], processes=gpu_processes(nvml, handle, index),
                        numa_node=numa, cpu_affinity=affinity, pci_path=sysfs_pci_path(bus, sys_root)))
    return NvmlDiscovery(tuple(gpus), None, known and ids_known, topology)


def _zero(reason: str, *, nvlink_known: bool = False) -> NvmlDiscovery:
    _warn_zero(reason)
    return NvmlDiscovery((), reason, nvlink_known)
