# -*- coding: utf-8 -*-
# Copyright: llmgw maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Filters over the control plane's ``GET /v1/replicas`` answer, for readiness checks
whose failure message tells the operator what is not Ready and why."""

from __future__ import annotations

from ansible.errors import AnsibleFilterError
from ansible_collections.llmgw.fleet.plugins.module_utils.fleet_states import REPLICA_READY
from ansible_collections.llmgw.fleet.plugins.module_utils.shard_states import READY as SHARD_READY


def short_deployments(deployments, replicas):
    """Each declared deployment with fewer Ready replicas than declared, as a sentence."""
    if not isinstance(deployments, list) or not isinstance(replicas, list):
        raise AnsibleFilterError("short_deployments: expected the declared deployments and the API's replicas as lists")
    short = []
    for dep in deployments:
        ready = sum(
            1 for r in replicas
            if isinstance(r, dict) and r.get("model") == dep.get("model") and r.get("profile") == dep.get("profile")
            and r.get("state") == REPLICA_READY
        )
        if ready < int(dep.get("replicas", 0)):
            short.append("%s/%s: %d of %d Ready" % (dep.get("model"), dep.get("profile"), ready, int(dep.get("replicas", 0))))
    return short


def _human_bytes(n):
    """``12.4 GiB``: binary units, one decimal from KiB up."""
    try:
        n = float(n)
    except (TypeError, ValueError):
        return str(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return "%d %s" % (n, unit) if unit == "B" else "%.1f %s" % (n, unit)
        n /= 1024.0
    return "%.1f TiB" % n


def _describe_progress(progress):
    """A shard's download progress (``downloading model.gguf 1.0 GiB of 4.0 GiB``), with its note."""
    done, total = progress.get("bytes_done") or 0, progress.get("bytes_total")
    text = "downloading %s %s" % (progress.get("file") or progress.get("source"), _human_bytes(done))
    text += (" of %s" % _human_bytes(total)) if total else " so far"
    if progress.get("note"):
        text += " (%s)" % progress["note"]
    return text


def describe_shard(shard):
    """``"shard <id> on <node> <state>: <reason>, downloading ..."``, from one shard of an API replica."""
    text = "shard %s on %s %s" % (shard.get("shard_id"), shard.get("node_id"), shard.get("state"))
    details = []
    if shard.get("reason"):
        details.append(str(shard["reason"]))
    if isinstance(shard.get("progress"), dict):
        details.append(_describe_progress(shard["progress"]))
    return text + (": " + ", ".join(details) if details else "")


def _describe_failure(failure):
    """A slot's last failure: ``"last failure (replica <id>, 15.8s ago): <reason>"``."""
    where = ", ".join(
        part for part in (
            "replica %s" % failure["replica_id"] if failure.get("replica_id") else "",
            "%ss ago" % failure["ago_s"] if failure.get("ago_s") is not None else "",
        ) if part)
    return "last failure%s: %s" % (" (%s)" % where if where else "", failure.get("reason"))


def describe_replica(replica):
    """``"<id> (<model>/<profile>) starting: <reason>; last failure (...): ...; shard ... failed: <reason>"``,
    from one API replica: the replica's own reason, its slot's last failure (when it was another
    replica's, or this one gives none), and every shard that is not Ready with its reason (a failed
    fetch, a digest mismatch, ...) and its download progress. A reason already given (a replica that
    failed because its shard did quotes the shard's reason) is not repeated."""
    if not isinstance(replica, dict):
        raise AnsibleFilterError("describe_replica: expected a replica object, got %r" % (replica,))
    text = "%s (%s/%s) %s" % (replica.get("replica_id"), replica.get("model"), replica.get("profile"), replica.get("state"))
    details = []
    if replica.get("reason"):
        details.append(str(replica["reason"]))
    failure = replica.get("last_failure")
    if isinstance(failure, dict) and failure.get("reason") and not any(str(failure["reason"]) in d for d in details):
        details.append(_describe_failure(failure))
    for shard in replica.get("shards") or ():
        if not isinstance(shard, dict) or shard.get("state") == SHARD_READY:
            continue
        if shard.get("reason") and not shard.get("progress") and any(str(shard["reason"]) in d for d in details):
            continue  # already said, in the replica's reason
        details.append(describe_shard(shard))
    return text + (": " + "; ".join(details) if details else "")


def describe_unplaced(entry):
    """``"<model>/<profile> #<slot>: <why placement found no room>; last failure: <reason>"``, from one
    API unplaced entry (a slot waiting out a restart backoff says why its last replica failed)."""
    if not isinstance(entry, dict):
        raise AnsibleFilterError("describe_unplaced: expected an unplaced object, got %r" % (entry,))
    text = "%s/%s #%s: %s" % (entry.get("model"), entry.get("profile"), entry.get("slot"), entry.get("reason"))
    failure = entry.get("last_failure")
    if isinstance(failure, dict) and failure.get("reason"):
        text += "; last failure: %s" % failure["reason"]
    return text


class FilterModule(object):
    """llmgw fleet readiness filters."""

    def filters(self):
        return {
            "short_deployments": short_deployments,
            "describe_replica": describe_replica,
            "describe_unplaced": describe_unplaced,
        }
