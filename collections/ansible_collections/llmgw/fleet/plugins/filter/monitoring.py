# -*- coding: utf-8 -*-
# Copyright: llmgw maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Prometheus file-based service discovery targets from the live fleet.

Pure: the live inventory's host variables (``llmgw_live_*``, from the
``llmgw.fleet.llmgw`` inventory plugin) in, ``file_sd_configs`` groups out, one
list per scrape job, sorted so that an unchanged fleet writes unchanged files.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from ansible.errors import AnsibleFilterError

JOBS = ("control_plane", "routers", "engines")


def _target(url, what):
    """``host:port`` and scheme of ``url``; an error naming ``what`` when it is not one."""
    parts = urlsplit(str(url))
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise AnsibleFilterError("prometheus_targets: %s: %r is not an http(s) URL" % (what, url))
    host = "[%s]" % parts.hostname if ":" in parts.hostname else parts.hostname
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return "%s:%d" % (host, port), parts.scheme


def _group(url, what, labels):
    target, scheme = _target(url, what)
    return {"targets": [target], "labels": dict(sorted({**labels, "__scheme__": scheme}.items()))}


def prometheus_targets(live_shards, control_plane_url="", routers=None, fleet="llmgw"):
    """``{"control_plane": [...], "routers": [...], "engines": [...]}``, file_sd groups for each job.

    ``live_shards`` maps node id to its ``llmgw_live_shards``. Engines are the
    shards that serve (the live inventory gives rank 0 of a replica an
    ``endpoint``), labelled with node, model, profile and replica.
    """
    if not isinstance(live_shards, dict):
        raise AnsibleFilterError("prometheus_targets: expected a mapping of node id to its llmgw_live_shards")
    base = {"fleet": str(fleet)}
    out = {job: [] for job in JOBS}
    if control_plane_url:
        out["control_plane"].append(_group(control_plane_url, "control_plane_url", base))
    for i, url in enumerate(routers or []):
        out["routers"].append(_group(url, "routers/%d" % i, base))
    for node in sorted(live_shards):
        for j, shard in enumerate(live_shards[node] or []):
            if not isinstance(shard, dict) or not shard.get("endpoint"):
                continue
            labels = dict(base, node=str(node), model=str(shard.get("model", "")),
                          profile=str(shard.get("profile", "")), replica=str(shard.get("replica_id", "")))
            out["engines"].append(_group(shard["endpoint"], "%s/llmgw_live_shards/%d/endpoint" % (node, j), labels))
    out["engines"].sort(key=lambda g: (g["targets"], sorted(g["labels"].items())))
    return out


class FilterModule(object):
    """llmgw monitoring filters."""

    def filters(self):
        return {"prometheus_targets": prometheus_targets}
