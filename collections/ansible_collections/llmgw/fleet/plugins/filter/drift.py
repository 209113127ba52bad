# -*- coding: utf-8 -*-
# Copyright: llmgw maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""drift.yml's host-by-host comparison of the declared fleet with the live one.

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


class FilterModule(object):
    """llmgw drift filters."""

    def filters(self):
        return {"drift_nodes": drift_nodes}
