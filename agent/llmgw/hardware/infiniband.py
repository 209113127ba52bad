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
I/O around it and never raises for what it finds on disk.  The collection's
``hca_validate`` reads sysfs with its own self-contained twin
(``plugins/module_utils/infiniband.py``, for hosts without llmgw); a unit
test holds the two to the same reading of every recorded sysfs tree.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

from llmgw.hardware import fabric_rules
from llmgw.hardware.fabric_rules import roce_v2_gid_index
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


def read_gids(port_dir: Path) -> dict[int, tuple[str, str]]:
    """``{index: (gid, type)}`` from ``gids/<i>`` and ``gid_attrs/types/<i>``
    (RoCE ports; the kernel answers EINVAL for a type of an empty entry)."""
    out: dict[int, tuple[str, str]] = {}
    try:
        entries = [e for e in (port_dir / "gids").iterdir() if e.name.isdigit()]
    except OSError:
        return out
    for e in entries:
        gid = _read_text(e)
        kind = _read_text(port_dir / "gid_attrs" / "types" / e.name)
        if isinstance(gid, str) and isinstance(kind, str):
            out[int(e.name)] = (gid.strip(), kind.strip())
    return out


def read_port(port_dir: Path) -> IBPort:
    texts: dict[str, str | OSError] = {}
    for name in PORT_FILES:
        raw = _read_text(port_dir / name)
        if raw is not None:
            texts[name] = raw
    port = port_from_texts(int(port_dir.name), texts)
    if port.link_layer == "Ethernet":
        port = dataclasses.replace(port, gid_index=roce_v2_gid_index(read_gids(port_dir)))
    return port


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


def describe_port(p: IBPort) -> str:
    """``"port 1: INIT, phys LinkUp"`` (plus why, if a file was unreadable)."""
    return fabric_rules.describe_port(p.to_dict())


def _rules_adapter(h: HCA) -> dict:
    return {"name": h.name, "node_guid": h.node_guid, "pci_bus_id": h.pci_bus_id,
            "ports": [dict(p.to_dict(), reason=p.reason, gid_index=p.gid_index) for p in h.ports]}


def check_fabric(decl: FabricDeclaration, discovered: Sequence[HCA]) -> FabricStatus:
    """One declared fabric against the adapters the node really has (``fabric_rules``).

    Only usable ports (ACTIVE and LinkUp, of the fabric's one link layer, on
    the card recorded at rollout) are advertised.  The fabric's rate is the
    slowest of them, unknown when any one's is.  A declared ``min_rate_gbps``
    that is not met is reported as a problem but does not withdraw the fabric:
    the links do carry traffic, only slower than planned, and refusing them
    would turn a performance problem into an outage.
    """
    status, _checks = fabric_rules.check_fabric(decl.to_rules(), [_rules_adapter(h) for h in discovered])
    return FabricStatus(
        name=status["name"],
        declared_hcas=tuple(status["declared_hcas"]),
        advertised_hcas=tuple(status["advertised_hcas"]),
        rate_gbps=status["rate_gbps"],
        problems=tuple(status["problems"]),
        link_layer=status["link_layer"],
        gid_index=status["gid_index"],
        rate_at_most_gbps=status["rate_at_most_gbps"],
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
    adapters = [{"name": h.name} for h in discovered]
    return statuses, tuple(fabric_rules.undeclared([d.to_rules() for d in declared], adapters))


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
