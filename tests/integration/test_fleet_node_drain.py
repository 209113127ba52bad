"""Cordon and drain a serving node with real processes, under streaming load through the router.

Three one-GPU nodes, two replicas: ``llmgw ctl drain NODE`` moves the
replica off its node to the free one, the replacement Ready before the old
engine is drained, while the official ``openai`` client streams through the
control plane's router; no request fails.  ``ctl nodes`` shows the drain
and ``uncordon`` makes the node schedulable again.
"""

from __future__ import annotations

import pytest

from fleet import Fleet, until
from openai_load import OpenAIStreams

pytestmark = pytest.mark.integration

PROFILE = {"env": {"LLMGW_SIM_TOKEN_LATENCY": "0.01"}}


def test_drain_a_serving_node_under_load_with_no_failed_request(tmp_path):
    with Fleet(tmp_path, nodes={"a": 1, "b": 1, "c": 1}, replicas=2, router=True, profile=PROFILE) as f:
        f.start()
        ready = f.wait_ready(2)
        node_of = {r["replica_id"]: r["shards"][0]["node_id"] for r in ready}
        victim_node = sorted(node_of.values())[0]
        victim = next(rid for rid, n in node_of.items() if n == victim_node)
        victim_pid = next(r for r in ready if r["replica_id"] == victim)["shards"][0]["pid"]
        free_node = next(n for n in f.node_ids.values() if n not in node_of.values())

        # cordon first: nothing moves, and the node is shown cordoned
        assert "cordoned" in f.ctl("cordon", victim_node).stdout
        assert f"{victim_node}: cordoned" in f.ctl("nodes").stdout
        assert {r["replica_id"] for r in f.ready_replicas()} == set(node_of)

        load = OpenAIStreams(f.router_url, verify=f.router_verify()).start()
        try:
            until(lambda: load.count() >= 5, "streams flowing", on_timeout=f.dump)
            assert "draining" in f.ctl("drain", victim_node).stdout

            def twin_seen():
                doc = f.try_get("/v1/replicas")
                return doc and next((r for r in doc["replicas"] if r.get("replaces") == victim), None)
            twin = until(twin_seen, "the replacement to be placed", on_timeout=f.dump)
            assert twin["shards"][0]["node_id"] == free_node
            # make before break: until the replacement is Ready, the old replica is still Ready
            doc = f.replicas()
            old = next(r for r in doc["replicas"] if r["replica_id"] == victim)
            new = next(r for r in doc["replicas"] if r["replica_id"] == twin["replica_id"])
            assert old["state"] == "ready" or new["state"] == "ready", (old["state"], new["state"])

            def drained():
                n = _node(f, victim_node)
                return n and n.get("drained")
            until(drained, "the node to be drained", on_timeout=f.dump)
            served_after = load.count()
            until(lambda: load.count() >= served_after + 5, "streams after the drain", on_timeout=f.dump)
        finally:
            load.stop()
        assert load.failures == [], load.failures[:5]
        final = f.wait_ready(2)
        assert {r["shards"][0]["node_id"] for r in final} == set(node_of.values()) - {victim_node} | {free_node}
        assert twin["replica_id"] in {r["replica_id"] for r in final}
        assert victim_pid not in f.engine_pids()
        out = f.ctl("nodes").stdout
        assert f"{victim_node}: drained: no replica left" in out, out
        # the old replica was drained after its twin was Ready: the server log says so in that order
        log = f.server.output(200000)
        assert f"{victim}: draining, {twin['replica_id']} on {free_node} is Ready in its place" in log

        assert "schedulable" in f.ctl("uncordon", victim_node).stdout
        assert _node(f, victim_node)["cordon"] is None
        print(f"\nnode drain under load: {load.count()} streams served, {len(load.failures)} failed")


def _node(f: Fleet, node_id: str) -> dict | None:
    doc = f.try_get("/v1/nodes")
    return None if doc is None else next((n for n in doc["nodes"] if n["node_id"] == node_id), None)
