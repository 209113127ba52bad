# -*- coding: utf-8 -*-
# Copyright: llmgw maintainers
# SPDX-License-Identifier: Apache-2.0 OR GPL-3.0-or-later
# This one file ships in two artifacts, each under its own licence: the llmgw
# package (Apache License 2.0, its LICENSE) and the llmgw.fleet collection
# (GNU General Public License v3.0 or later, its COPYING).
"""The rules that decide which declared RDMA ports a fabric may use, and the words for why not.

One file, two homes: the agent (``llmgw.hardware.fabric_rules``) applies it
on every discovery, and the collection's ``hca_validate`` module
(``plugins/module_utils/fabric_rules.py``, an identical copy that a unit test
holds to this one) applies it at rollout, so both refuse the same ports with
the same sentences.  Standard library only, plain dicts in and out, because
the module runs on hosts without llmgw installed.

A declared entry is an adapter (``mlx5_0``: every port) or one port of it
(``mlx5_0:1``, NCCL's spelling).  A port is usable when its state is ACTIVE
*and* its physical state LinkUp: ACTIVE while retraining
(LinkErrorRecovery) or Polling carries no data.  A fabric has one link
layer, declared or taken from its first usable port: InfiniBand and RoCE
(Ethernet) ports cannot talk to each other, so a port of the other kind is
not advertised.  What is advertised is spelled as NCCL_IB_HCA reads it: the
adapter's name when every port of it is usable, else each usable port
(``mlx5_0:1``), so a dual-rail card that lost a rail is named exactly.  When
the adapter's identity (node GUID, PCI address) was recorded at rollout, a
card found under a declared name with another identity (another real GUID,
or, where GUIDs are missing, all zero or equal, another PCI address) is not used, and a
rename message names where the recorded card went.  Any usable port whose
rate cannot be read makes the fabric's rate unknown ("at most" the known
ones), and then ``min_rate_gbps`` cannot be checked.  For RoCE, the RoCE v2
GID index (IPv4-mapped first) is what NCCL_IB_GID_INDEX must be.
"""

from __future__ import annotations

import re

INFINIBAND = "InfiniBand"
ETHERNET = "Ethernet"
LAYER_WORDS = {INFINIBAND: "InfiniBand", ETHERNET: "Ethernet (RoCE)"}

_REF = re.compile(r"^([A-Za-z0-9_.-]+?)(?::([1-9][0-9]*))?$")

# What an operator can do about a port in a given (state, phys_state).
HINTS = {
    ("INIT", "LinkUp"): "INIT with LinkUp: the cable is up but no subnet manager has activated the port",
    ("ARMED", "LinkUp"): "ARMED: the subnet manager has not finished activating the port",
    ("DOWN", "Polling"): "Polling: no link partner; check the cable and the switch port",
    ("DOWN", "Disabled"): "Disabled: the port is administratively down",
}

ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
IPV4_MAPPED = "0000:0000:0000:0000:0000:ffff:"


def parse_ref(ref):
    """``"mlx5_0:1"`` -> ``("mlx5_0", 1)``; ``"mlx5_0"`` -> ``("mlx5_0", None)``; None if malformed."""
    match = _REF.match(ref)
    if not match:
        return None
    return match.group(1), (int(match.group(2)) if match.group(2) else None)


def declaration_errors(fabrics):
    """``(pointer, message)`` for each port claimed by two fabrics (or twice by one).

    ``mlx5_0`` claims every port of the card, so it conflicts with any
    ``mlx5_0:N`` elsewhere: the second fabric would be advertised through the
    first one's cable.
    """
    errors = []
    claims = {}  # (adapter, port or None) -> (fabric name, pointer)
    for i, fabric in enumerate(fabrics):
        for j, ref in enumerate(fabric.get("hcas") or ()):
            where = "/fabrics/%d/hcas/%d" % (i, j)
            parsed = parse_ref(ref)
            if parsed is None:
                errors.append((where, "%r is not an adapter name or name:port (e.g. mlx5_0 or mlx5_0:1)" % ref))
                continue
            name, port = parsed
            clash = None
            for (other_name, other_port), (other_fabric, other_where) in claims.items():
                if other_name == name and (port is None or other_port is None or port == other_port):
                    clash = (other_name, other_port, other_fabric, other_where)
                    break
            if clash is not None:
                what = ref if port is not None or clash[1] is None else "%s (every port, including %s:%d)" % (
                    ref, name, clash[1])
                errors.append((where, "%s is also claimed by fabric %s (%s): a port carries one fabric" % (
                    what, clash[2], clash[3])))
                continue
            claims[(name, port)] = (fabric["name"], where)
    return errors


def roce_v2_gid_index(gids):
    """The GID index NCCL_IB_GID_INDEX should name, from ``{index: (gid, type)}``
    read from ``ports/N/gids/<i>`` and ``gid_attrs/types/<i>``: the lowest RoCE v2
    entry with an IPv4-mapped address, else the lowest RoCE v2 entry; None if none."""
    v2 = sorted(i for i, (gid, kind) in gids.items() if kind.strip() == "RoCE v2" and gid.strip() != ZERO_GID)
    mapped = [i for i in v2 if gids[i][0].strip().lower().startswith(IPV4_MAPPED)]
    if mapped:
        return mapped[0]
    return v2[0] if v2 else None


def describe_port(port):
    """``"port 1: INIT, phys LinkUp"`` (plus why, if a file was unreadable)."""
    text = "port %d: %s, phys %s" % (port["port"], port["state"], port["phys_state"])
    if port.get("reason"):
        text += " [%s]" % port["reason"]
    return text


def _fmt(rate):
    return ("%f" % rate).rstrip("0").rstrip(".")


def _inactive(name, ports):
    if not ports:
        return "%s: no ACTIVE port (no ports found)" % name
    details = "; ".join(describe_port(p) for p in ports)
    hints = sorted(set(HINTS[k] for k in ((p["state"], p["phys_state"]) for p in ports) if k in HINTS))
    text = "%s: no ACTIVE port (%s)" % (name, details)
    if hints:
        text += "; " + "; ".join(hints)
    return text


def _identity_text(ident):
    parts = []
    if ident.get("node_guid"):
        parts.append("node GUID %s" % ident["node_guid"])
    if ident.get("pci_bus_id"):
        parts.append("PCI %s" % ident["pci_bus_id"])
    return ", ".join(parts) or "no identity"


def _guid(ident):
    """A node GUID that names one card, lowercased; None when missing or all zero.

    SR-IOV virtual functions report 0000:0000:0000:0000 until a GUID is
    assigned: every such card "matches" every other, so it proves nothing.
    """
    guid = (ident.get("node_guid") or "").strip().lower()
    return guid if guid.strip("0:") else None


def _same_card(adapter, ident):
    """Does ``adapter`` match a recorded identity?

    Two real GUIDs that differ are two cards.  Otherwise (a GUID missing,
    all zero, or the same) the PCI addresses decide when both are known:
    two virtual functions with zero GUIDs that swap names at boot differ
    only there.
    """
    mine, theirs = _guid(adapter), _guid(ident)
    if mine and theirs and mine != theirs:
        return False
    if ident.get("pci_bus_id") and adapter.get("pci_bus_id"):
        return adapter["pci_bus_id"].lower() == ident["pci_bus_id"].lower()
    return True  # nothing more to compare


def check_fabric(decl, adapters):
    """One declared fabric against the adapters found (rules in the module docstring).

    ``decl``: ``name``, ``hcas`` (names or name:port), optional
    ``min_rate_gbps``, ``link_layer`` and ``identities`` (adapter name ->
    ``node_guid``/``pci_bus_id`` recorded at rollout).  ``adapters``: dicts with
    ``name``, ``node_guid``, ``pci_bus_id`` and ``ports`` (``port``, ``state``,
    ``phys_state``, ``rate_gbps``, ``rate_text``, ``link_layer``, ``reason``,
    ``gid_index``).  Returns the fabric's status (``advertised_hcas`` in
    NCCL_IB_HCA spelling, ``link_layer``, ``rate_gbps``, ``rate_at_most_gbps``,
    ``gid_index``, ``problems``) and one check per declared entry.
    """
    by_name = dict((a["name"], a) for a in adapters)
    found = ", ".join(sorted(by_name, key=_natural)) or "none"
    identities = decl.get("identities") or {}
    layer = decl.get("link_layer")
    layer_from = "declared" if layer else None
    advertised, problems, checks = [], [], []
    usable_ports = []  # (adapter name, port, its check)
    for ref in list(dict.fromkeys(decl["hcas"])):
        name, want = parse_ref(ref) or (ref, None)
        check = {"fabric": decl["name"], "hca": ref, "present": name in by_name, "ok": False,
                 "node_guid": None, "pci_bus_id": None, "ports": [], "active_ports": [], "rate_gbps": None,
                 "problems": []}
        checks.append(check)
        mine = check["problems"]
        adapter = by_name.get(name)
        recorded = identities.get(name)
        moved = None
        if recorded:
            moved = next((a["name"] for a in adapters if a["name"] != name and _same_card(a, recorded)
                          and (recorded.get("node_guid") or recorded.get("pci_bus_id"))), None)
        if adapter is None:
            if moved:
                mine.append("%s: absent; the card recorded as %s (%s) is now %s: renamed at boot? "
                            "update the declaration" % (name, name, _identity_text(recorded), moved))
            else:
                mine.append("%s: absent (found: %s)" % (name, found))
            continue
        check["node_guid"], check["pci_bus_id"] = adapter.get("node_guid"), adapter.get("pci_bus_id")
        check["ports"] = adapter["ports"]
        if recorded and not _same_card(adapter, recorded):
            text = "%s: not the card recorded at rollout (now %s, recorded %s)" % (
                name, _identity_text(adapter), _identity_text(recorded))
            if moved:
                text += "; the recorded card is now %s: renamed at boot? update the declaration" % moved
            mine.append(text)
            continue
        ports = [p for p in adapter["ports"] if want is None or p["port"] == want]
        if want is not None and not ports:
            listed = ", ".join(str(p["port"]) for p in adapter["ports"]) or "none"
            mine.append("%s: no port %d (ports: %s)" % (name, want, listed))
            continue
        active = [p for p in ports if p["state"] == "ACTIVE"]
        check["active_ports"] = [p["port"] for p in active]
        if not active:
            mine.append(_inactive(ref, ports))
            continue
        good = []
        for p in active:
            if p["phys_state"] != "LinkUp":
                mine.append("%s: port %d is ACTIVE but phys %s: the physical link is not up; not advertised" % (
                    name, p["port"], p["phys_state"]))
                continue
            if layer is None:
                layer, layer_from = p["link_layer"], "taken from %s port %d" % (name, p["port"])
            if p["link_layer"] != layer:
                mine.append("%s: port %d is %s, fabric %s is %s (%s): InfiniBand and RoCE ports cannot talk to "
                            "each other; not advertised" % (
                                name, p["port"], LAYER_WORDS.get(p["link_layer"], p["link_layer"]),
                                decl["name"], LAYER_WORDS.get(layer, layer), layer_from))
                continue
            good.append(p)
        if not good:
            continue
        if want is None and len(good) == len(adapter["ports"]):
            advertised.append(name)
        else:
            advertised.extend("%s:%d" % (name, p["port"]) for p in good)
        usable_ports.extend((name, p, check) for p in good)
        known = [p["rate_gbps"] for p in good if p.get("rate_text")]
        check["rate_gbps"] = min(known) if known else None
    # rate: the slowest usable port; any unknown one makes it unknown
    slowest = None
    unknown = []
    for name, p, _check in usable_ports:
        if not p.get("rate_text"):
            unknown.append("%s port %d" % (name, p["port"]))
            continue
        if slowest is None or p["rate_gbps"] < slowest[0]:
            slowest = (p["rate_gbps"], "%s port %d, %s" % (name, p["port"], p["rate_text"]))
    rate = None if unknown or slowest is None else slowest[0]
    at_most = slowest[0] if unknown and slowest is not None else None
    fabric_problems = []
    for name, p, check in usable_ports:
        if not p.get("rate_text"):
            text = "%s: port %d is ACTIVE but its rate is unknown [%s]; the fabric's rate is unknown" % (
                name, p["port"], p.get("reason"))
            if at_most is not None:
                text += " (at most %s Gb/s)" % _fmt(at_most)
            check["problems"].append(text)
    minimum = decl.get("min_rate_gbps")
    if minimum is not None and usable_ports:
        if rate is not None and rate < minimum:
            fabric_problems.append("rate %s Gb/s is below min_rate_gbps %s (slowest: %s)" % (
                _fmt(rate), _fmt(minimum), slowest[1]))
        elif rate is None:
            fabric_problems.append("min_rate_gbps %s cannot be checked: rate of %s unknown" % (
                _fmt(minimum), ", ".join(unknown)))
    gid_index = None
    if layer == ETHERNET and usable_ports:
        indices = dict(("%s:%d" % (n, p["port"]), p.get("gid_index")) for n, p, _c in usable_ports)
        values = sorted(set(v for v in indices.values() if v is not None))
        if len(values) == 1 and None not in indices.values():
            gid_index = values[0]
        elif values:  # none found anywhere: nothing to tell NCCL, it picks its own
            fabric_problems.append("no one RoCE v2 GID index for every port (%s): NCCL_IB_GID_INDEX takes one "
                                   "value; NCCL picks its own" % ", ".join(
                                       "%s %s" % (k, "none" if v is None else v) for k, v in sorted(indices.items())))
    for check in checks:
        check["ok"] = not check["problems"]
        problems.extend(check["problems"])
    problems.extend(fabric_problems)
    status = {
        "name": decl["name"],
        "declared_hcas": list(dict.fromkeys(decl["hcas"])),
        "advertised_hcas": advertised,
        "link_layer": layer if usable_ports or decl.get("link_layer") else None,
        "rate_gbps": rate,
        "rate_at_most_gbps": at_most,
        "slowest_link": None if slowest is None else slowest[1],
        "gid_index": gid_index,
        "problems": problems,
    }
    return status, checks


def undeclared(declared, adapters):
    """Adapters found that no declared fabric names (by name or name:port)."""
    named = set()
    for fabric in declared:
        for ref in fabric["hcas"]:
            named.add((parse_ref(ref) or (ref, None))[0])
    return sorted((a["name"] for a in adapters if a["name"] not in named), key=_natural)


def _natural(name):
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name))
