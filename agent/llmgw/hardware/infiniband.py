"""InfiniBand / RoCE adapters from sysfs, and declared fabrics checked against them.

The kernel's ib_core publishes every RDMA adapter under ``/sys/class/infiniband``
(each entry a symlink into ``/sys/devices``), with one directory per port
holding ``state`` ("4: ACTIVE"), ``phys_state`` ("5: LinkUp"), ``rate``
("200 Gb/sec (4X HDR)") and ``link_layer`` ("InfiniBand" or "Ethernet").

Fabric membership is configuration: every OpenSM subnet has the same default
prefix, so nothing on the wire says which fabric an adapter is cabled to.
What the node *can* check is that each declared adapter exists and has a port
that carries traffic.  An adapter that is absent (a typo, a card renamed after
a reboot) or whose ports are not ACTIVE (INIT with LinkUp: cabled, but no
subnet manager) would otherwise end up in NCCL_IB_HCA, and the replica would
pass its health checks and then hang on its first all-reduce.  So such an
adapter is not advertised, and the reason names it.

Parsing is pure (``parse_*`` over the files' text); ``read_hcas`` is the thin
I/O around it and never raises for what it finds on disk.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

from llmgw.hardware.types import HCA, FabricDeclaration, FabricStatus, IBPort

log = logging.getLogger(__name__)

DEFAULT_SYSFS_ROOT = "/sys/class/infiniband"

# The value a field gets when its file cannot be read or parsed.
UNKNOWN = "UNKNOWN"
# The kernel's own word for a link layer it cannot name; reused when the file is unreadable.
UNKNOWN_LINK_LAYER = "Unknown"

# drivers/infiniband/core/sysfs.c: state_show / phys_state_show.
PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
PHYS_STATES = {
    1: "Sleep",
    2: "Polling",
    3: "Disabled",
    4: "PortConfigurationTraining",
    5: "LinkUp",
    6: "LinkErrorRecovery",
    7: "Phy Test",
}

_ENUM_LINE = re.compile(r"^\s*(\d+)\s*:\s*(\S(?:.*\S)?)\s*$")
# rate_show: "%d%s Gb/sec (%dX%s)" where %s is "" or ".5" and the speed name
# may be empty (SDR): "2.5 Gb/sec (1X)", "10 Gb/sec (4X)", "200 Gb/sec (4X HDR)".
_RATE_LINE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*Gb/sec(?:\s*\(([^()]*)\))?\s*$")


class SysfsFormatError(ValueError):
    """A sysfs file whose text is not in the kernel's format."""


def parse_enum_line(text: str) -> tuple[int, str]:
    """``"4: ACTIVE\\n"`` -> ``(4, "ACTIVE")``; the format of state and phys_state."""
    m = _ENUM_LINE.match(text)
    if not m:
        raise SysfsFormatError(f"expected '<number>: <name>', got {text.strip()!r}")
    return int(m.group(1)), m.group(2)


_STATE_NAMES = frozenset(PORT_STATES.values()) | {UNKNOWN}  # the kernel prints UNKNOWN past its table


def parse_state(text: str) -> str:
    """The logical port state's name: "ACTIVE", "INIT", "ARMED", "DOWN" ..."""
    name = parse_enum_line(text)[1]
    if name not in _STATE_NAMES:
        raise SysfsFormatError(f"unknown port state {text.strip()!r}")
    return name


def parse_phys_state(text: str) -> str:
    """The physical port state's name: "LinkUp", "Polling", "Disabled" ..."""
    return parse_enum_line(text)[1]


def parse_rate(text: str) -> tuple[float, str]:
    """``"200 Gb/sec (4X HDR)\\n"`` -> ``(200.0, "200 Gb/sec (4X HDR)")``."""
    m = _RATE_LINE.match(text)
    if not m:
        raise SysfsFormatError(f"expected '<n> Gb/sec (<width>X <speed>)', got {text.strip()!r}")
    return float(m.group(1)), text.strip()


LINK_LAYERS = ("InfiniBand", "Ethernet", UNKNOWN_LINK_LAYER)  # link_layer_show's words


def parse_link_layer(text: str) -> str:
    value = text.strip()
    if value not in LINK_LAYERS:
        raise SysfsFormatError(f"expected one of {', '.join(LINK_LAYERS)}, got {value!r}")
    return value


def port_from_texts(port: int, texts: dict[str, str | OSError]) -> IBPort:
    """Build a port from the text of each file (or the error reading it).

    A missing or malformed file leaves its field UNKNOWN (0.0 for the rate)
    and says why in ``reason``; the port is then never ACTIVE unless its
    ``state`` file said so.
    """
    problems: list[str] = []

    def field(name: str, parse, default):
        raw = texts.get(name)
        if raw is None:
            problems.append(f"{name}: missing")
            return default
        if isinstance(raw, OSError):
            problems.append(f"{name}: cannot read ({raw.strerror or raw})")
            return default
        try:
            return parse(raw)
        except SysfsFormatError as e:
            problems.append(f"{name}: {e}")
            return default

    state = field("state", parse_state, UNKNOWN)
    phys_state = field("phys_state", parse_phys_state, UNKNOWN)
    rate_gbps, rate_text = field("rate", parse_rate, (0.0, ""))
    link_layer = field("link_layer", parse_link_layer, UNKNOWN_LINK_LAYER)
    return IBPort(
        port=port,
        state=state,
        phys_state=phys_state,
        rate_gbps=rate_gbps,
        rate_text=rate_text,
        link_layer=link_layer,
        reason="; ".join(problems) or None,
    )


PORT_FILES = ("state", "phys_state", "rate", "link_layer")


def _read_text(path: Path) -> str | OSError | None:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return None
    except OSError as e:  # EACCES, EIO/EINVAL from the driver, a directory ...
        return e


def read_port(port_dir: Path) -> IBPort:
    texts: dict[str, str | OSError] = {}
    for name in PORT_FILES:
        raw = _read_text(port_dir / name)
        if raw is not None:
            texts[name] = raw
    return port_from_texts(int(port_dir.name), texts)


def natural_key(name: str) -> tuple:
    """Sort mlx5_2 before mlx5_10, as a person reading a list expects."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


_PCI_ADDRESS = re.compile(r"^[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")


def pci_location(hca_dir: Path) -> tuple[str | None, tuple[str, ...] | None, int | None]:
    """The adapter's PCI device, its path from the root bus, and its NUMA node.

    ``class/infiniband/<hca>`` links to ``devices/pci0000:16/.../0000:17:00.0/
    infiniband/<hca>``: the PCI device is the directory above ``infiniband``
    and the path is every directory from ``pci<domain>:<bus>`` down to it.
    ``numa_node`` there is the kernel's (-1, or absent, when the platform
    does not say: unknown).
    """
    try:
        target = hca_dir.resolve(strict=True)
    except OSError:
        return None, None, None
    device = target.parent.parent
    if target.parent.name != "infiniband" or not _PCI_ADDRESS.match(device.name):
        return None, None, None
    parts = device.parts
    start = next((i for i, p in enumerate(parts) if p.startswith("pci") and ":" in p), None)
    path = None if start is None else tuple(parts[start:])
    numa: int | None = None
    raw = _read_text(device / "numa_node")
    if isinstance(raw, str):
        try:
            numa = int(raw.strip())
        except ValueError:
            numa = None
        if numa is not None and numa < 0:
            numa = None
    return device.name, path, numa


def read_node_guid(hca_dir: Path) -> str | None:
    raw = _read_text(hca_dir / "node_guid")
    if not isinstance(raw, str):
        return None
    value = raw.strip().lower()
    return value if re.fullmatch(r"[0-9a-f]{4}(:[0-9a-f]{4}){3}", value) else None


def read_hca(hca_dir: Path) -> HCA:
    """One adapter; its directory is usually a symlink, which is followed."""
    bus, path, numa = pci_location(hca_dir)
    where = {"pci_bus_id": bus, "pci_path": path, "numa_node": numa, "node_guid": read_node_guid(hca_dir)}
    ports_dir = hca_dir / "ports"
    try:
        entries = sorted(ports_dir.iterdir(), key=lambda p: natural_key(p.name))
    except OSError as e:
        log.debug("%s: cannot list ports: %s", hca_dir.name, e)
        return HCA(name=hca_dir.name, ports=(), **where)
    ports = []
    for entry in entries:
        if not entry.name.isdigit():
            continue
        ports.append(read_port(entry))
    return HCA(name=hca_dir.name, ports=tuple(ports), **where)


def read_hcas(root: str | Path = DEFAULT_SYSFS_ROOT) -> tuple[HCA, ...]:
    """Every adapter under ``root``; none when the directory does not exist
    (no RDMA driver loaded, or a node without adapters)."""
    root = Path(root)
    try:
        entries = sorted(root.iterdir(), key=lambda p: natural_key(p.name))
    except FileNotFoundError:
        return ()
    except OSError as e:
        log.warning("cannot list %s: %s; no InfiniBand adapters seen", root, e)
        return ()
    return tuple(read_hca(e) for e in entries if not e.name.startswith("."))


# --- declared against discovered ------------------------------------------

_HINTS = {
    ("INIT", "LinkUp"): "INIT with LinkUp: the cable is up but no subnet manager has activated the port",
    ("ARMED", "LinkUp"): "ARMED: the subnet manager has not finished activating the port",
    ("DOWN", "Polling"): "Polling: no link partner; check the cable and the switch port",
    ("DOWN", "Disabled"): "Disabled: the port is administratively down",
}


def describe_port(p: IBPort) -> str:
    """``"port 1: INIT, phys LinkUp"`` (plus why, if a file was unreadable)."""
    text = f"port {p.port}: {p.state}, phys {p.phys_state}"
    if p.reason:
        text += f" [{p.reason}]"
    return text


def _inactive_problem(hca: HCA) -> str:
    if not hca.ports:
        return f"{hca.name}: no ACTIVE port (no ports found)"
    details = "; ".join(describe_port(p) for p in hca.ports)
    hints = sorted({h for p in hca.ports if (h := _HINTS.get((p.state, p.phys_state)))})
    text = f"{hca.name}: no ACTIVE port ({details})"
    if hints:
        text += "; " + "; ".join(hints)
    return text


def _dedupe(names: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))


def check_fabric(decl: FabricDeclaration, discovered: Sequence[HCA]) -> FabricStatus:
    """One declared fabric against the adapters the node really has.

    Only adapters present with an ACTIVE port are advertised.  The fabric's
    rate is the slowest ACTIVE port among them: a collective runs at the
    speed of its slowest link.  A declared ``min_rate_gbps`` that is not met
    is reported as a problem but does not withdraw the fabric: the links do
    carry traffic, only slower than planned, and refusing them would turn a
    performance problem into an outage.
    """
    by_name = {h.name: h for h in discovered}
    found = ", ".join(sorted(by_name, key=natural_key)) or "none"
    declared = _dedupe(decl.hcas)
    advertised: list[str] = []
    problems: list[str] = []
    slowest: tuple[float, str] | None = None  # (rate, "mlx5_1 port 1, 100 Gb/sec (4X EDR)")
    unknown_rate = False
    for name in declared:
        hca = by_name.get(name)
        if hca is None:
            problems.append(f"{name}: absent (found: {found})")
            continue
        active = hca.active_ports
        if not active:
            problems.append(_inactive_problem(hca))
            continue
        advertised.append(name)
        for p in active:
            if not p.rate_text:  # the rate file could not be read
                unknown_rate = True
                problems.append(f"{name}: port {p.port} is ACTIVE but its rate is unknown [{p.reason}]")
                continue
            if slowest is None or p.rate_gbps < slowest[0]:
                slowest = (p.rate_gbps, f"{name} port {p.port}, {p.rate_text}")
    rate = None if slowest is None else slowest[0]
    if decl.min_rate_gbps is not None and advertised:
        if rate is not None and rate < decl.min_rate_gbps:
            assert slowest is not None
            problems.append(
                f"rate {rate:g} Gb/s is below min_rate_gbps {decl.min_rate_gbps:g} "
                f"(slowest: {slowest[1]})"
            )
        elif rate is None and unknown_rate:
            problems.append(f"rate unknown, cannot check min_rate_gbps {decl.min_rate_gbps:g}")
    return FabricStatus(
        name=decl.name,
        declared_hcas=declared,
        advertised_hcas=tuple(advertised),
        rate_gbps=rate,
        problems=tuple(problems),
    )


def validate_fabrics(
    declared: Sequence[FabricDeclaration], discovered: Sequence[HCA]
) -> tuple[tuple[FabricStatus, ...], tuple[str, ...]]:
    """Each declared fabric's status, and the discovered adapters no fabric names.

    Undeclared adapters are reported so an operator can spot a rename
    (mlx5_0 declared, mlx5_2 found), but never used: membership is only
    what the operator declared.  Pure; ``log_fabric_problems`` logs.
    """
    statuses = tuple(check_fabric(d, discovered) for d in declared)
    named = {n for d in declared for n in d.hcas}
    undeclared = tuple(sorted((h.name for h in discovered if h.name not in named), key=natural_key))
    return statuses, undeclared


def log_fabric_problems(statuses: Iterable[FabricStatus], logger: logging.Logger = log) -> None:
    """One WARNING per problem, on the node: the operator who typed the
    adapter name is the one who can fix it, and this is where both the
    declaration and the hardware are visible."""
    for s in statuses:
        for problem in s.problems:
            if s.usable:
                logger.warning("fabric %s: %s", s.name, problem)
            else:
                logger.warning("fabric %s (not advertised: no usable adapter): %s", s.name, problem)


_logged_undeclared: set[str] = set()
_logged_lock = threading.Lock()


def log_undeclared(names: Iterable[str], logger: logging.Logger = log) -> None:
    """One INFO per adapter found that no fabric declares, the first time it is seen.

    The inventory already lists it, but the operator reading this node's log
    is the one who can tell a renamed card (mlx5_0 declared, mlx5_2 found)
    from a spare.  Once per process: the agent rediscovers on every reconnect.
    """
    for name in names:
        with _logged_lock:
            if name in _logged_undeclared:
                continue
            _logged_undeclared.add(name)
        logger.info("adapter %s found but in no declared fabric, so not used: "
                    "fabric membership is configuration (fabrics[].hcas in agent.yaml)", name)


def _reset_logged() -> None:
    """Forget which undeclared adapters were logged (for tests)."""
    with _logged_lock:
        _logged_undeclared.clear()
