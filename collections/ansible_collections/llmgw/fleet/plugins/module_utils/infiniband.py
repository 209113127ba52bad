# -*- coding: utf-8 -*-
# Copyright: llmgw maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""InfiniBand / RoCE adapters as sysfs shows them, and declared fabrics checked against them.

The kernel's ib_core publishes every RDMA adapter under ``/sys/class/infiniband``
(each entry a symlink into ``/sys/devices``), one directory per port holding
``state`` ("4: ACTIVE"), ``phys_state`` ("5: LinkUp"), ``rate``
("200 Gb/sec (4X HDR)") and ``link_layer`` ("InfiniBand" or "Ethernet").

This is the deployment-time twin of the agent's own discovery: modules run on
hosts where the llmgw runtime may not be installed yet, so the small parse
lives here rather than being imported. The rules, and the words of every
problem, are the agent's own file (``fabric_rules``, kept identical to
``llmgw/hardware/fabric_rules.py`` by a unit test), and
``tests/unit/test_hardware_infiniband_twin.py`` holds this reader to the
agent's (``llmgw.hardware.infiniband.read_hcas``) over every recorded sysfs
tree, so rollout and the agent read the same ports. Parsing is pure
(``parse_*`` over file text); the readers never raise for what they find on disk.
"""

from __future__ import annotations

import os
import re

from ansible_collections.llmgw.fleet.plugins.module_utils import fabric_rules

DEFAULT_SYSFS_ROOT = "/sys/class/infiniband"
UNKNOWN = "UNKNOWN"
UNKNOWN_LINK_LAYER = "Unknown"

# drivers/infiniband/core/sysfs.c: state_show.
PORT_STATES = ("NOP", "DOWN", "INIT", "ARMED", "ACTIVE", "ACTIVE_DEFER")
LINK_LAYERS = ("InfiniBand", "Ethernet", UNKNOWN_LINK_LAYER)
PORT_FILES = ("state", "phys_state", "rate", "link_layer")

_PCI_ADDRESS = re.compile(r"^[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")
_ENUM_LINE = re.compile(r"^\s*(\d+)\s*:\s*(\S(?:.*\S)?)\s*$")
# rate_show: "%d%s Gb/sec (%dX%s)": "2.5 Gb/sec (1X)", "10 Gb/sec (4X)", "200 Gb/sec (4X HDR)".
_RATE_LINE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*Gb/sec(?:\s*\(([^()]*)\))?\s*$")


class SysfsFormatError(ValueError):
    """A sysfs file whose text is not in the kernel's format."""


def parse_enum_line(text):
    """``"4: ACTIVE\\n"`` -> ``(4, "ACTIVE")``, the format of state and phys_state."""
    match = _ENUM_LINE.match(text)
    if not match:
        raise SysfsFormatError("expected '<number>: <name>', got %r" % text.strip())
    return int(match.group(1)), match.group(2)


def parse_state(text):
    name = parse_enum_line(text)[1]
    if name not in PORT_STATES and name != UNKNOWN:
        raise SysfsFormatError("unknown port state %r" % text.strip())
    return name


def parse_phys_state(text):
    return parse_enum_line(text)[1]


def parse_rate(text):
    """``"200 Gb/sec (4X HDR)"`` -> ``(200.0, "200 Gb/sec (4X HDR)")``."""
    match = _RATE_LINE.match(text)
    if not match:
        raise SysfsFormatError("expected '<n> Gb/sec (<width>X <speed>)', got %r" % text.strip())
    return float(match.group(1)), text.strip()


def parse_link_layer(text):
    value = text.strip()
    if value not in LINK_LAYERS:
        raise SysfsFormatError("expected one of %s, got %r" % (", ".join(LINK_LAYERS), value))
    return value


def port_from_texts(number, texts):
    """A port dict from each file's text, an ``OSError`` reading it, or nothing.

    A missing or malformed file leaves its field UNKNOWN (0.0 for the rate)
    and says why in ``reason``; such a port is never ACTIVE unless its
    ``state`` file said so.
    """
    problems = []

    def field(name, parse, default):
        raw = texts.get(name)
        if raw is None:
            problems.append("%s: missing" % name)
            return default
        if isinstance(raw, OSError):
            problems.append("%s: cannot read (%s)" % (name, raw.strerror or raw))
            return default
        try:
            return parse(raw)
        except SysfsFormatError as exc:
            problems.append("%s: %s" % (name, exc))
            return default

    state = field("state", parse_state, UNKNOWN)
    phys_state = field("phys_state", parse_phys_state, UNKNOWN)
    rate_gbps, rate_text = field("rate", parse_rate, (0.0, ""))
    link_layer = field("link_layer", parse_link_layer, UNKNOWN_LINK_LAYER)
    return {
        "port": number,
        "state": state,
        "phys_state": phys_state,
        "rate_gbps": rate_gbps,
        "rate_text": rate_text,
        "link_layer": link_layer,
        "reason": "; ".join(problems) or None,
    }


def _read_text(path):
    try:
        with open(path, "rb") as handle:
            return handle.read().decode("utf-8", "replace")
    except (IOError, OSError) as exc:
        if getattr(exc, "errno", None) == 2:  # ENOENT: the file is not there
            return None
        return exc  # EACCES, EIO/EINVAL from the driver, a directory ...


def natural_key(name):
    """Sort mlx5_2 before mlx5_10, as a person reading a list expects."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name))


def _listdir(path):
    try:
        return sorted(os.listdir(path), key=natural_key)
    except (IOError, OSError):
        return None


def read_gids(port_dir):
    """``{index: (gid, type)}`` from ``gids/<i>`` and ``gid_attrs/types/<i>`` (RoCE ports)."""
    out = {}
    for entry in _listdir(os.path.join(port_dir, "gids")) or ():
        if not entry.isdigit():
            continue
        gid = _read_text(os.path.join(port_dir, "gids", entry))
        kind = _read_text(os.path.join(port_dir, "gid_attrs", "types", entry))
        if isinstance(gid, str) and isinstance(kind, str):
            out[int(entry)] = (gid.strip(), kind.strip())
    return out


def read_port(port_dir):
    texts = {}
    for name in PORT_FILES:
        raw = _read_text(os.path.join(port_dir, name))
        if raw is not None:
            texts[name] = raw
    port = port_from_texts(int(os.path.basename(port_dir)), texts)
    port["gid_index"] = fabric_rules.roce_v2_gid_index(read_gids(port_dir)) if port["link_layer"] == "Ethernet" else None
    return port


def read_adapter(adapter_dir):
    """One adapter; its directory is usually a symlink into /sys/devices, which is followed."""
    ports_dir = os.path.join(adapter_dir, "ports")
    guid = _read_text(os.path.join(adapter_dir, "node_guid"))
    ports = [read_port(os.path.join(ports_dir, entry)) for entry in (_listdir(ports_dir) or ()) if entry.isdigit()]
    # class/infiniband/<name> links to .../<pci address>/infiniband/<name>: the PCI device is two up.
    device = os.path.basename(os.path.dirname(os.path.dirname(os.path.realpath(adapter_dir))))
    return {
        "name": os.path.basename(adapter_dir),
        "node_guid": guid.strip() if isinstance(guid, str) and guid.strip() else None,
        "pci_bus_id": device if _PCI_ADDRESS.match(device) else None,
        "ports": ports,
    }


def read_adapters(root=DEFAULT_SYSFS_ROOT):
    """Every adapter under ``root``; none when it does not exist (no RDMA driver, no adapters)."""
    entries = _listdir(root)
    if entries is None:
        return []
    return [read_adapter(os.path.join(root, entry)) for entry in entries if not entry.startswith(".")]


def check_fabrics(declared, adapters):
    """Compare declared fabrics (agent.yaml's ``fabrics``) with the adapters found.

    The rules and their words are the agent's own (``fabric_rules``, the same
    file the runtime applies on every discovery).  Returns ``(checks, fabrics,
    undeclared, problems)``: one check per declared entry, one status per
    fabric (the agent's FabricStatus shape), the adapters present that no
    fabric names, and every problem as a sentence naming its fabric and
    adapter.  A declared ``min_rate_gbps`` that is not met is a problem here:
    at deployment time the operator can still fix it.
    """
    by_name = dict((a["name"], a) for a in adapters)
    checks, fabrics, problems = [], [], []
    for fabric in declared:
        status, fabric_checks = fabric_rules.check_fabric(fabric, adapters)
        checks.extend(fabric_checks)
        fabrics.append(status)
        problems.extend("fabric %s: %s" % (fabric["name"], p) for p in status["problems"])
    undeclared = fabric_rules.undeclared(declared, adapters)
    if undeclared and any(not c["present"] for c in checks):
        # An absent adapter next to an undeclared one is usually a rename after a reboot.
        described = ", ".join(
            "%s (node GUID %s)" % (n, by_name[n]["node_guid"]) if by_name[n]["node_guid"] else n for n in undeclared
        )
        problems.append("present but not declared: %s; was an adapter renamed?" % described)
    return checks, fabrics, undeclared, problems


def identities(adapters):
    """Each adapter's identity, for agent.yaml's ``fabrics[].identities``: recorded at
    rollout, checked by the agent on every discovery."""
    return dict((a["name"], dict((k, a[k]) for k in ("node_guid", "pci_bus_id") if a.get(k))) for a in adapters)
