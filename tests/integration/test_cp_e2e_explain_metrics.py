"""``llmgw ctl explain`` and ``/metrics`` against a real server with real agents.

``ctl explain MODEL`` exits 0 when every declared replica of the model runs
or can be placed, and 3 when one cannot (ctl/fleet.py ``explain_online``);
the why-not text lists every node with its verdict.  ``/metrics`` is parsed
with prometheus_client's own parser, never matched as text.
"""

from __future__ import annotations

import json

import pytest
import yaml

from fleet import GIB, Fleet, metric_samples, until

pytestmark = pytest.mark.integration


def catalog_with_unplaceable(f: Fleet) -> None:
    """Add a model needing more GPUs than any node has, and one needing more memory than any GPU."""
    f.config["models"] += [{"name": "wide", "source": "org/wide"},
                           {"name": "heavy", "source": "org/heavy", "size_bytes": 2000 * GIB}]
    f.config["profiles"] += [{"name": "tp8", "engine": "vllm", "tensor_parallel_size": 8, "start_timeout": 60}]
    f.config["deployments"] += [{"model": "wide", "profile": "tp8", "replicas": 1},
                                {"model": "heavy", "profile": "sim", "replicas": 1}]
    f.write_config()


def test_ctl_explain_lists_every_node_and_why_not_and_exits_3_when_unplaceable(tmp_path):
    with Fleet(tmp_path, nodes={"a": 2, "b": 1}, replicas=1) as f:
        catalog_with_unplaceable(f)
        f.start()
        a, b = f.node_ids["a"], f.node_ids["b"]
        until(lambda: len(f.nodes()) == 2, "both nodes registered", on_timeout=f.dump)
        (tiny,) = f.wait_ready(1)

        # More GPUs than any node has.
        res = f.ctl("explain", "wide", check=False)
        assert res.returncode == 3, (res.returncode, res.stdout, res.stderr)
        lines = res.stdout.splitlines()
        assert lines[0] == "wide/tp8#0:", res.stdout
        assert "no placement for" in res.stdout and "8 GPU" in res.stdout, res.stdout
        verdicts = {ln.split()[0]: ln.split(None, 2)[1:] for ln in lines if ln.split()[:1] in ([a], [b])}
        assert set(verdicts) == {a, b}, res.stdout
        assert all(v[0] == "no" for v in verdicts.values()), res.stdout
        tiny_on_b = tiny["shards"][0]["node_id"] == b
        free_a, free_b = (2, 0) if tiny_on_b else (1, 1)
        assert verdicts[a][1] == f"{free_a} free GPU{'' if free_a == 1 else 's'}, needs 8", res.stdout
        assert verdicts[b][1] == f"{free_b} free GPU{'' if free_b == 1 else 's'}, needs 8", res.stdout
        doc = json.loads(f.ctl("explain", "wide", "-o", "json", check=False).stdout)
        (item,) = doc["replicas"]
        assert item["placed"] is False and item["running"] is None and item["reason"]
        assert {n["node"]: n["ok"] for n in item["nodes"]} == {a: False, b: False}
        assert all(n["reason"] for n in item["nodes"])

        # More memory than any GPU has: nodes have free GPUs but are still refused, each with a reason.
        res = f.ctl("explain", "heavy", check=False)
        assert res.returncode == 3, (res.returncode, res.stdout, res.stderr)
        doc = json.loads(f.ctl("explain", "heavy", "-o", "json", check=False).stdout)
        (item,) = doc["replicas"]
        assert item["placed"] is False
        assert {n["node"] for n in item["nodes"]} == {a, b} and not any(n["ok"] for n in item["nodes"])
        for n in item["nodes"]:
            assert n["node"] in res.stdout and n["reason"] in res.stdout
        assert any("memory" in n["reason"].lower() or "GiB" in n["reason"] for n in item["nodes"]), item
        # The control plane holds the same verdict for the slot it could not fill.
        unplaced = {(u["model"], u["profile"]): u["reason"] for u in f.replicas()["unplaced"]}
        assert ("wide", "tp8") in unplaced and ("heavy", "sim") in unplaced, unplaced

        # The placed case: running, exit 0.
        res = f.ctl("explain", "tiny")
        assert res.returncode == 0
        assert f"tiny/sim: running as {tiny['replica_id']} (ready)" in res.stdout, res.stdout
        node = tiny["shards"][0]["node_id"]
        assert f"r0 on {node} GPUs {tiny['shards'][0]['gpus'][0]} (ready)" in res.stdout, res.stdout

        # An unknown model is an error, not a placement.
        res = f.ctl("explain", "nosuch", check=False)
        assert res.returncode == 1 and "404" in res.stderr, (res.stdout, res.stderr)


def test_ctl_explain_of_a_placeable_but_not_running_replica_exits_0_and_names_the_node(tmp_path):
    # Startup grace long enough that nothing is placed yet: explain shows where it would go.
    with Fleet(tmp_path, nodes={"a": 2, "b": 1}, replicas=1, lifecycle={"startup_grace": 600}) as f:
        f.start()
        until(lambda: len(f.nodes()) == 2, "both nodes registered", on_timeout=f.dump)
        res = f.ctl("explain", "tiny")
        assert res.returncode == 0
        doc = json.loads(f.ctl("explain", "tiny", "-o", "json").stdout)
        (item,) = doc["replicas"]
        assert item["placed"] is True and item["running"] is None
        (shard,) = item["placement"]["shards"]
        assert shard["node"] in f.node_ids.values()
        assert {n["node"]: n["ok"] for n in item["nodes"]}[shard["node"]] is True
        assert ": placed (" in res.stdout and "startup grace" in res.stdout, res.stdout
        assert not f.engine_pids()


def samples_of(m: dict, name: str) -> dict[tuple, float]:
    return {tuple(sorted(labels.items())): v for labels, v in m.get(name, [])}


def test_metrics_of_a_small_fleet(tmp_path):
    with Fleet(tmp_path, nodes={"a": 2, "b": 1}, replicas=2) as f:
        # Node b could not read its NVLink topology.
        hw = tmp_path / "b" / "hardware.yaml"
        doc = yaml.safe_load(hw.read_text())
        doc["nvlink_known"] = False
        hw.write_text(yaml.safe_dump(doc))
        f.start()
        a, b = f.node_ids["a"], f.node_ids["b"]
        ready = f.wait_ready(2)
        until(lambda: len(f.nodes()) == 2, "both nodes registered", on_timeout=f.dump)
        m = metric_samples(f)

        def one(name: str, **labels: str) -> float:
            got = [v for lab, v in m.get(name, []) if lab == labels]
            assert len(got) == 1, (name, labels, m.get(name))
            return got[0]

        for node in (a, b):
            assert one("llmgw_node_state", node=node, state="ready") == 1.0
            assert one("llmgw_node_state", node=node, state="unreachable") == 0.0
            assert one("llmgw_node_state", node=node, state="lost") == 0.0
            assert one("llmgw_node_connected", node=node) == 1.0
        assert one("llmgw_node_gpus", node=a) == 2.0 and one("llmgw_node_gpus", node=b) == 1.0
        used = {n: sum(1 for r in ready for s in r["shards"] if s["node_id"] == n) for n in (a, b)}
        assert one("llmgw_node_gpus_free", node=a) == 2 - used[a]
        assert one("llmgw_node_gpus_free", node=b) == 1 - used[b]
        assert one("llmgw_node_nvlink_known", node=a) == 1.0
        assert one("llmgw_node_nvlink_known", node=b) == 0.0
        assert samples_of(m, "llmgw_gpu_nvlink_peers") == {
            (("gpu", "0"), ("node", a)): 1.0, (("gpu", "1"), ("node", a)): 1.0, (("gpu", "0"), ("node", b)): 0.0}

        states = ("starting", "ready", "failed", "stopping", "draining")
        rstate = samples_of(m, "llmgw_replica_state")
        assert len(rstate) == 2 * len(states), rstate
        for r in ready:
            for st in states:
                key = (("model", "tiny"), ("profile", "sim"), ("replica", r["replica_id"]), ("state", st))
                assert rstate[key] == (1.0 if st == "ready" else 0.0), (key, rstate)
        counts = samples_of(m, "llmgw_replicas")
        assert counts == {(("model", "tiny"), ("profile", "sim"), ("state", st)): (2.0 if st == "ready" else 0.0)
                          for st in states}, counts
        assert samples_of(m, "llmgw_replicas_desired") == {(("model", "tiny"), ("profile", "sim")): 2.0}
        assert samples_of(m, "llmgw_fleet_damped") == {(): 0.0}
        assert samples_of(m, "llmgw_fleet_unreachable_share") == {(): 0.0}
