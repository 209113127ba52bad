"""A two-node replica through ``llmgw server`` and two ``llmgw agent`` processes.

Both agents declare fabric ``ib-a`` and their hardware files carry an
adapter with an ACTIVE port, so each advertises the fabric and multi-node
placement can use them.  The simulator plays vLLM's multi-node shape: rank 0
serves HTTP (``--nnodes 2 --node-rank 0``), rank 1 runs ``--headless`` and
serves nothing.  Rank 0 is Ready only after a one-token completion; rank 1,
which has no HTTP to probe, by liveness.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from fleet import Fleet, edit_agent_config, until

pytestmark = pytest.mark.integration

HCA = {"name": "mlx5_0", "ports": [{"port": 1, "state": "ACTIVE", "phys_state": "LinkUp", "rate_gbps": 200.0,
                                    "rate_text": "200 Gb/sec (4X HDR)", "link_layer": "InfiniBand"}]}


def on_fabric(f: Fleet, name: str) -> None:
    hw = f.agents[name].cwd / "hardware.yaml"
    doc = yaml.safe_load(hw.read_text())
    doc["hcas"] = [HCA]
    hw.write_text(yaml.safe_dump(doc))
    edit_agent_config(f.agents[name], lambda d: d.__setitem__("fabrics", [{"name": "ib-a", "hcas": ["mlx5_0"]}]))


def test_two_node_replica_rank0_by_completion_rank1_by_liveness_and_losing_rank1_leaves_ready(tmp_path):
    with Fleet(tmp_path, nodes={"a": 1, "b": 1}, replicas=1,
               profile={"nodes": 2, "tensor_parallel_size": 2},
               restart={"backoff_initial": 300, "backoff_max": 300}) as f:
        for name in ("a", "b"):
            on_fabric(f, name)
        f.start()
        nodes = until(lambda: len(n := f.nodes()) == 2 and n, "both nodes registered", on_timeout=f.dump)
        for n in nodes.values():
            (fab,) = n["fabrics"]
            assert fab["name"] == "ib-a" and fab["advertised_hcas"] == ["mlx5_0"] and fab["rate_gbps"] == 200.0, n

        (r,) = f.wait_ready(1)
        r0, r1 = r["shards"]
        assert (r0["rank"], r1["rank"]) == (0, 1)
        assert {r0["node_id"], r1["node_id"]} == set(f.node_ids.values())  # one shard per node
        assert r0["state"] == r1["state"] == "ready"
        assert r0["port"] and r1["port"] is None and r0["master_port"]
        assert r["endpoint"] == f"http://127.0.0.1:{r0['port']}"
        assert "ib-a" in (r["placement"] or ""), r["placement"]

        def engine_log(shard: dict) -> str:
            # the engine's own output, and beside it the agent's notes on it (its launch argv among them)
            agent = next(a for n, a in f.agents.items() if f.node_ids[n] == shard["node_id"])
            base = agent.cwd / "state" / "logs" / quote(shard["shard_id"], safe="")
            return "".join(Path(f"{base}{ext}").read_text(errors="replace") for ext in (".agent.log", ".log"))

        logs = {s["rank"]: engine_log(s) for s in (r0, r1)}
        # Nothing but the agent's readiness probe talks to this engine (no router in this
        # fleet): the completion it served is the probe's.
        text = httpx.get(f"http://127.0.0.1:{r0['port']}/metrics", timeout=30).text
        served = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
        assert served.get("vllm:generation_tokens_total", 0) >= 1, text
        # Rank 0 answered a real completion before it was called ready; rank 1 was never asked
        # (it binds nothing) and runs headless against rank 0's rendezvous port.
        assert "--node-rank 0" in logs[0] and "--nnodes 2" in logs[0] and "--headless" not in logs[0]
        assert "--headless" in logs[1] and "--node-rank 1" in logs[1]
        assert f"--master-port {r0['master_port']}" in logs[1] and "--master-addr 127.0.0.1" in logs[1]
        assert "headless multiproc executor" in logs[1]
        server_log = f.server.output(10**7)
        assert f"{r1['shard_id']}: start on {r1['node_id']}" in server_log
        assert f"(rendezvous 127.0.0.1:{r0['master_port']})" in server_log

        # Kill rank 1's engine: the replica is no longer Ready, and rank 0 is stopped with it.
        os.killpg(r1["pid"], signal.SIGKILL)

        def out_of_ready():
            doc = f.replicas()
            mine = next((x for x in doc["replicas"] if x["replica_id"] == r["replica_id"]), None)
            return (mine is None or mine["state"] != "ready") and doc
        doc = until(out_of_ready, "the replica to leave ready", on_timeout=f.dump)
        assert not f.ready_replicas()
        until(lambda: r0["pid"] not in f.engine_pids(), "rank 0's engine stopped with its replica", on_timeout=f.dump)
        with f.client() as c:
            eps = c.get("/v1/router/endpoints").json()["endpoints"]
        assert r["replica_id"] not in {e["replica_id"] for e in eps}
        failure = f.server.output(10**7)
        assert f"{r['replica_id']}: failed (shard r1 on {r1['node_id']} failed" in failure
