# -*- coding: utf-8 -*-
# Copyright: llmgw maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Filters over the control plane's ``GET /v1/replicas`` answer, for readiness checks
whose failure message tells the operator what is not Ready and why."""

from __future__ import annotations

from ansible.errors import AnsibleFilterError


def short_deployments(deployments, replicas):
    """Each declared deployment with fewer Ready replicas than declared, as a sentence."""
    if not isinstance(deployments, list) or not isinstance(replicas, list):
        raise AnsibleFilterError("short_deployments: expected the declared deployments and the API's replicas as lists")
    short = []
    for dep in deployments:
        ready = sum(
            1 for r in replicas
            if isinstance(r, dict) and r.get("model") == dep.get("model") and r.get("profile") == dep.get("profile")
            and r.get("state") == "ready"
        )
        if ready < int(dep.get("replicas", 0)):
            short.append("%s/%s: %d of %d Ready" % (dep.get("model"), dep.get("profile"), ready, int(dep.get("replicas", 0))))
    return short


def describe_replica(replica):
    """``"<id> (<model>/<profile>) starting: <reason>; last failure: ..."``, from one API replica."""
    if not isinstance(replica, dict):
        raise AnsibleFilterError("describe_replica: expected a replica object, got %r" % (replica,))
    text = "%s (%s/%s) %s" % (replica.get("replica_id"), replica.get("model"), replica.get("profile"), replica.get("state"))
    details = []
    if replica.get("reason"):
        details.append(str(replica["reason"]))
    failure = replica.get("last_failure")
    if failure:
        details.append("last failure: %s" % ", ".join("%s=%s" % (k, v) for k, v in sorted(failure.items()) if k != "output_tail"))
    for shard in replica.get("shards") or ():
        if isinstance(shard, dict) and shard.get("state") != "ready":
            details.append("shard %s on %s %s" % (shard.get("shard_id"), shard.get("node_id"), shard.get("state")))
    return text + (": " + "; ".join(details) if details else "")


def describe_unplaced(entry):
    """``"<model>/<profile> #<slot>: <why placement found no room>"``, from one API unplaced entry."""
    if not isinstance(entry, dict):
        raise AnsibleFilterError("describe_unplaced: expected an unplaced object, got %r" % (entry,))
    return "%s/%s #%s: %s" % (entry.get("model"), entry.get("profile"), entry.get("slot"), entry.get("reason"))


class FilterModule(object):
    """llmgw fleet readiness filters."""

    def filters(self):
        return {
            "short_deployments": short_deployments,
            "describe_replica": describe_replica,
            "describe_unplaced": describe_unplaced,
        }
