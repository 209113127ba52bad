# -*- coding: utf-8 -*-
# Copyright: llmgw maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""drift.yml's comparison of the declared fleet with the live one, host by host and deployment by deployment.

It was a Jinja loop. At thousands of nodes that loop cost time in the square of the
fleet: each ``host in <list of live nodes>`` walked ansible-core's lazy list and
checked every element's tags (at 10,000 nodes about four minutes of CPU). Here the
node names are sets, each declared host's variables are read once, and the
comparison is one pass.
"""

from __future__ import annotations

from datetime import datetime

from ansible.errors import AnsibleFilterError
from ansible.module_utils.parsing.convert_bool import boolean
from ansible_collections.llmgw.fleet.plugins.module_utils.fleet_states import NODE_READY

_RENDER_HINT = " (its agent.yaml was not rendered from this declaration: run site.yml)"


def _difference(kind, node, message):
    return {"kind": kind, "node": node, "model": None, "message": message}


def _fabric_differences(host, declared, live_fabrics):
    """One declared fabric against what the agent reports for it."""
    name = declared.get("name")
    live = next((f for f in live_fabrics if isinstance(f, dict) and f.get("name") == name), None)
    if live is None:
        return [_difference("fabric_not_reported", host,
                            "%s: fabric %s is declared but the agent does not report it%s" % (host, name, _RENDER_HINT))]
    out = []
    advertised = live.get("advertised_hcas") or []
    for hca in declared.get("hcas") or []:
        if hca in advertised:
            continue
        why = [p for p in live.get("problems") or [] if str(p).startswith("%s:" % hca)]
        out.append(_difference("hca_not_advertised", host, "%s: fabric %s: declared HCA %s is not advertised: %s" % (
            host, name, hca, "; ".join(why) if why else "the agent does not declare it" + _RENDER_HINT)))
    minimum = declared.get("min_rate_gbps")
    if minimum is not None and advertised:
        rate = live.get("rate_gbps")
        if rate is None:
            out.append(_difference("fabric_rate_unknown", host, "%s: fabric %s: rate unknown, declared minimum %s Gb/s cannot be checked"
                                   % (host, name, minimum)))
        elif float(rate) < float(minimum):
            out.append(_difference("fabric_rate_below_minimum", host, "%s: fabric %s: rate %s Gb/s is below the declared minimum %s Gb/s"
                                   % (host, name, rate, minimum)))
    return out


def _live_node_differences(host, hv, version):
    """A declared node the control plane knows: its state, fabrics and agent version."""
    out = []
    state = hv.get("llmgw_live_state")
    if state != NODE_READY:
        reason = hv.get("llmgw_live_reason")
        out.append(_difference("node_not_ready", host, "%s: %s for %ss%s" % (
            host, state, hv.get("llmgw_live_state_for_s"), (": %s" % reason) if reason else "")))
    live_fabrics = hv.get("llmgw_live_fabrics") or []
    for fabric in hv.get("llmgw_fabrics") or []:
        out.extend(_fabric_differences(host, fabric, live_fabrics))
    want = hv.get("llmgw_agent_version")
    want = version if want is None else want
    running = hv.get("llmgw_live_agent_version")
    if running != want:
        out.append(_difference("agent_version", host, "%s: agent %s is running, %s is declared" % (host, running, want)))
    return out


def _certificate_differences(host, hv, now, renew_days):
    """The certificate the agent presented to the control plane, else the one read from the node
    (drift.yml's first play sets ``_drift_cert`` only for nodes the control plane reports none for)."""
    presented = hv.get("llmgw_live_certificate")
    cert = hv.get("_drift_cert")
    days = hv.get("llmgw_pki_renew_days")
    days = renew_days if days is None else days
    if isinstance(presented, dict) and presented.get("not_after"):
        not_after = datetime.strptime(presented["not_after"], "%Y-%m-%dT%H:%M:%S%z")
        if not_after.timestamp() - now < int(days) * 86400:
            return [_difference("certificate_expiring", host, (
                "%s: the certificate the agent presented to the control plane (serial %s) expires %s, within the renewal"
                " window of %s days: run site.yml to re-issue it") % (host, presented.get("serial"), presented["not_after"], days))]
        return []
    if not isinstance(cert, dict):
        return []
    if cert.get("error"):
        return [_difference("certificate_unchecked", host, "%s: the control plane reports no certificate for it, and %s could not be read"
                            " from the node: %s" % (host, cert.get("path"), cert["error"]))]
    if boolean(cert.get("expiring"), strict=False):
        return [_difference("certificate_expiring", host, (
            "%s: certificate %s read from the node (the control plane reports none) expires %s, within the renewal window"
            " of %s days: run site.yml to re-issue it") % (host, cert.get("path"), cert.get("not_after"), cert.get("renew_days")))]
    return []


def drift_nodes(declared, live, hostvars, url, version, now, renew_days, agent_group):
    """Every node-level difference between the declared nodes and the live ones, in declaration order
    then live order: ``[{kind, node, model, message}]``. ``hostvars`` maps a host to its variables;
    each host's are read once."""
    if not isinstance(declared, list) or not isinstance(live, list):
        raise AnsibleFilterError("drift_nodes: expected the declared and the live node names as lists")
    try:
        now = float(now)
    except (TypeError, ValueError):
        raise AnsibleFilterError("drift_nodes: now must be a timestamp, got %r" % (now,))
    declared_set, live_set = set(declared), set(live)
    out = []
    for host in declared:
        hv = hostvars[host]
        if host not in live_set:
            out.append(_difference("node_not_registered", host,
                                   "%s: declared, but not registered with the control plane at %s" % (host, url)))
        else:
            out.extend(_live_node_differences(host, hv, version))
        out.extend(_certificate_differences(host, hv, now, renew_days))
    for host in live:
        if host in declared_set:
            continue
        hv = hostvars[host]
        out.append(_difference("node_not_declared", host, "%s: registered (%s, agent %s), but not declared in %s" % (
            host, hv.get("llmgw_live_state"), hv.get("llmgw_live_agent_version"), agent_group)))
    return out


# ------------------------------------------------------------------ deployments
# server.schema.json's default for $defs/autoscale/min (held equal by tests/ansible/test_drift_filter.py): a
# declaration that leaves min out means 1, and the live catalog's block has its defaults filled in.
AUTOSCALE_MIN_DEFAULT = 1
_RENDER = " (server.yaml was not rendered from this declaration: run site.yml)"


def _number(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


def _same(declared, live):
    """Declared and live settings equal, numbers by value (a declared 60 is the catalog's 60.0)."""
    if isinstance(declared, dict):
        return isinstance(live, dict) and all(_same(v, live.get(k)) for k, v in declared.items())
    return _number(declared) == _number(live)


def _bounds(block):
    return "%s..%s" % (block.get("min", AUTOSCALE_MIN_DEFAULT), block.get("max"))


def _autoscale_setting_differences(declared, live):
    """``min``, ``max`` and every other key the declaration sets, where the live catalog's block differs."""
    wanted = dict(declared, min=declared.get("min", AUTOSCALE_MIN_DEFAULT))
    return ["%s %s declared, %s live" % (k, _shown(v), _shown(live.get(k)))
            for k, v in sorted(wanted.items()) if not _same(v, live.get(k))]


def _shown(value):
    if isinstance(value, dict):
        return "{%s}" % ", ".join("%s: %s" % (k, _shown(v)) for k, v in sorted(value.items()))
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _detail_lines(key, live):
    """Why replicas are missing: those not Ready, unplaced slots, and placement's explanation."""
    lines = []
    for r in live.get("not_ready") or []:
        lines.append("  %s %s%s" % (r.get("replica_id"), r.get("state"), (": %s" % r["reason"]) if r.get("reason") else ""))
    for u in live.get("unplaced") or []:
        lines.append("  %s#%s not placed: %s" % (key, u.get("slot"), u.get("reason")))
    for e in live.get("explain") or []:
        if not e.get("placed") or e.get("held") is not None:
            lines.append("\n".join(("  " + line) if line else line for line in str(e.get("text", "")).split("\n")))
    return lines


def _deployment(kind, d, message, **extra):
    return dict({"kind": kind, "node": None, "model": d.get("model"), "profile": d.get("profile"), "message": message},
                **extra)


def _static_differences(key, d, live):
    """A fixed count: fewer Ready replicas than declared is drift (and so is a catalog that autoscales it)."""
    declared = int(d.get("replicas") or 0)
    if isinstance(live.get("autoscale"), dict):
        return [_deployment("autoscale_bounds", d, "%s: declared with a fixed count of %d, but the control plane's catalog "
                            "autoscales it %s%s" % (key, declared, _bounds(live["autoscale"]), _RENDER))]
    ready = int(live.get("ready") or 0)
    if ready >= declared:
        return []
    lines = ["%s: %d of %d declared replicas Ready" % (key, ready, declared)]
    if int(live.get("replicas") or 0) < declared:
        lines.append("  the control plane's catalog asks for %s%s" % (live.get("replicas") or 0, _RENDER))
    return [_deployment("replicas_short", d, "\n".join(lines + _detail_lines(key, live)), declared=declared, ready=ready)]


def _autoscaled_differences(key, d, live):
    """An autoscaled deployment's count moves with demand: drift is bounds that differ from the live catalog's, or
    a live count outside the declared min..max, never a count that differs from ``replicas`` or ``min``."""
    declared = d["autoscale"]
    block = live.get("autoscale")
    if not isinstance(block, dict):
        return [_deployment("autoscale_bounds", d, "%s: declared to autoscale %s, but the control plane's catalog %s%s" % (
            key, _bounds(declared), "has a fixed count of %s" % live["replicas"] if "replicas" in live else "does not have it",
            _RENDER))]
    settings = _autoscale_setting_differences(declared, block)
    if settings:
        return [_deployment("autoscale_bounds", d, "%s: autoscale %s declared, %s in the control plane's catalog: %s%s" % (
            key, _bounds(declared), _bounds(block), "; ".join(settings), _RENDER))]
    low, high = int(declared.get("min", AUTOSCALE_MIN_DEFAULT)), int(declared["max"])
    ready = int(live.get("ready") or 0)
    current = live.get("current")
    current = ready if current is None else int(current)
    now = "desired %s (%s)" % (live.get("desired"), live.get("reason")) if live.get("desired") is not None else "no decision"
    extra = {"min": low, "max": high, "ready": ready, "current": current, "desired": live.get("desired")}
    if ready < low and live.get("reason") != "lent":  # lent: its GPUs serve another model, by its own setting
        lines = ["%s: %d Ready, below the declared min of %d (autoscale %d..%d, %s)" % (key, ready, low, low, high, now)]
        return [_deployment("autoscale_below_min", d, "\n".join(lines + _detail_lines(key, live)), **extra)]
    if current > high:
        return [_deployment("autoscale_above_max", d, "%s: %d replicas running, above the declared max of %d (autoscale "
                            "%d..%d, %s)" % (key, current, high, low, high, now), **extra)]
    return []


def drift_deployments(declared, live):
    """Every deployment-level difference, in declaration order: ``[{kind, node: None, model, profile, message, ...}]``.

    ``declared`` is ``llmgw_deployments``; ``live`` is ``llmgw_live_fleet.deployments`` (keyed ``MODEL/PROFILE``).
    A deployment with a fixed count drifts when fewer replicas are Ready than declared (``replicas_short``). An
    autoscaled one drifts only when its bounds differ from the live catalog's (``autoscale_bounds``) or its live
    count leaves them: fewer Ready than ``min`` (``autoscale_below_min``), more running than ``max``
    (``autoscale_above_max``)."""
    if not isinstance(declared, list) or not isinstance(live, dict):
        raise AnsibleFilterError("drift_deployments: expected llmgw_deployments (a list) and the live deployments (a dict)")
    out = []
    for d in declared:
        if not isinstance(d, dict):
            raise AnsibleFilterError("drift_deployments: a declared deployment is %r, not a mapping" % (d,))
        key = "%s/%s" % (d.get("model"), d.get("profile"))
        mine = live.get(key)
        mine = mine if isinstance(mine, dict) else {"ready": 0}
        if isinstance(d.get("autoscale"), dict):
            out.extend(_autoscaled_differences(key, d, mine))
        else:
            out.extend(_static_differences(key, d, dict({"replicas": 0}, **mine)))
    return out


class FilterModule(object):
    """llmgw drift filters."""

    def filters(self):
        return {"drift_nodes": drift_nodes, "drift_deployments": drift_deployments}
