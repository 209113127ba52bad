"""plugins/filter/monitoring.py: the live inventory's shards into Prometheus file_sd groups.

The role's end-to-end test (tests/inventory/test_monitoring.py) runs it on a real
fleet; here the cases a small fleet does not show: IPv6, several nodes in order,
non-serving shards, and a bad URL named by where it came from.
"""

from __future__ import annotations

import pytest
from ansible.errors import AnsibleFilterError

from fleet_harness import REPO
from fleet_harness import load_plugin

monitoring = load_plugin(REPO / "collections/ansible_collections/llmgw/fleet/plugins/filter/monitoring.py")


def shard(replica, endpoint=None, rank=0):
    return {"replica_id": replica, "model": "m", "profile": "p", "rank": rank, "endpoint": endpoint}


def test_engines_are_serving_shards_sorted_and_labelled():
    out = monitoring.prometheus_targets(
        {"n2": [shard("r2", "http://10.0.0.2:31000")],
         "n1": [shard("r1", "http://[fd00::1]:30000"), shard("r3", None, rank=1), "junk"]},
        control_plane_url="https://cp.example:8443", routers=["http://cp.example:8080", "https://r2.example"])
    assert out["control_plane"] == [{"targets": ["cp.example:8443"], "labels": {"__scheme__": "https", "fleet": "llmgw"}}]
    assert [g["targets"] for g in out["routers"]] == [["cp.example:8080"], ["r2.example:443"]]
    assert out["engines"] == [
        {"targets": ["10.0.0.2:31000"], "labels": {"__scheme__": "http", "fleet": "llmgw", "model": "m",
                                                   "node": "n2", "profile": "p", "replica": "r2"}},
        {"targets": ["[fd00::1]:30000"], "labels": {"__scheme__": "http", "fleet": "llmgw", "model": "m",
                                                    "node": "n1", "profile": "p", "replica": "r1"}},
    ]


def test_an_empty_fleet_gives_empty_jobs():
    assert monitoring.prometheus_targets({}) == {"control_plane": [], "routers": [], "engines": []}


@pytest.mark.parametrize("kwargs,where", [
    ({"control_plane_url": "cp.example:8443"}, "control_plane_url"),
    ({"routers": ["http://ok:1", "ftp://r"]}, "routers/1"),
    ({"live": {"n1": [shard("r1", "http://")]}}, "n1/llmgw_live_shards/0/endpoint"),
])
def test_a_bad_url_is_named_by_where_it_came_from(kwargs, where):
    live = kwargs.pop("live", {})
    with pytest.raises(AnsibleFilterError, match=f"{where}: .* is not an http"):
        monitoring.prometheus_targets(live, **kwargs)


def test_not_a_mapping_is_refused():
    with pytest.raises(AnsibleFilterError, match="mapping of node id"):
        monitoring.prometheus_targets([])
