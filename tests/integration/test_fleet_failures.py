"""Failures in a real fleet and what the control plane makes of them.

Server, agents and simulator engines are separate processes over real
mutual TLS; every condition is read back through the admin API or
``llmgw ctl``, the way an operator would see it.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from fleet import Fleet, until

pytestmark = pytest.mark.integration


def only_replica(f: Fleet) -> dict:
    (r,) = f.wait_ready(1)
    return r


def test_engine_killed_while_its_agent_lives_leaves_ready_and_is_replaced(tmp_path):
    with Fleet(tmp_path, nodes={"a": 1}, replicas=1) as f:
        f.start()
        old = only_replica(f)
        pid = old["shards"][0]["pid"]
        os.killpg(pid, signal.SIGKILL)
        new = until(lambda: next((r for r in f.ready_replicas() if r["replica_id"] != old["replica_id"]), None),
                    "a replacement replica ready", on_timeout=f.dump)
        assert new["shards"][0]["pid"] != pid
        assert new["slot"] == old["slot"] and new["restarts"] == 1
        assert new["last_failure"]["replica_id"] == old["replica_id"]
        assert "failed" in new["last_failure"]["reason"]
        ids = {r["replica_id"] for r in f.replicas()["replicas"]}
        assert old["replica_id"] not in ids
        log = f.server.output(10**7)
        assert f"{old['replica_id']}: failed (shard r0 on {f.node_ids['a']} failed" in log
        assert f.engine_pids() == [new["shards"][0]["pid"]]


def test_agent_restarting_with_nothing_running_reaches_the_reconciler_through_the_stream(tmp_path):
    # Long lifecycle timings: only the registration itself can explain what follows.
    with Fleet(tmp_path, nodes={"a": 1}, replicas=1,
               lifecycle={"unreachable_after": 60, "lost_after": 120}) as f:
        f.start()
        old = only_replica(f)
        node = f.node_ids["a"]
        agent = f.agents["a"]
        agent.kill()
        os.killpg(old["shards"][0]["pid"], signal.SIGKILL)  # dies while no agent watches it
        until(lambda: not f.engine_pids(), "the engine to be gone")
        agent.start()
        until(lambda: "0 engine(s) adopted" in agent.life_output(), "the agent to find nothing to adopt",
              on_timeout=agent.output)
        new = until(lambda: next((r for r in f.ready_replicas() if r["replica_id"] != old["replica_id"]), None),
                    "the replica to be replaced", on_timeout=f.dump)
        assert new["shards"][0]["node_id"] == node
        n = f.nodes()[node]
        assert n["registrations"] == 2 and n["state"] == "ready"
        log = f.server.output(10**7)
        assert f"node {node} registered (epoch 2, agent 0.1.0, 1 GPUs, 0 shard(s) reported)" in log
        assert f"{old['shards'][0]['shard_id']} on {node}: let go (not reported by {node} when it registered" in log
        assert "-> unreachable" not in log


def test_half_open_streams_are_dropped_by_keepalive_long_before_the_unreachable_grace(tmp_path):
    # A frozen process keeps its TCP connection open and answers nothing: the
    # shape of a peer behind a dead link. Lifecycle timings are long, so only
    # the keepalive pings can explain a stream being dropped.
    with Fleet(tmp_path, nodes={"a": 1}, replicas=1, agent_keepalive=1.0,
               lifecycle={"unreachable_after": 60, "lost_after": 120}) as f:
        f.start()
        (ready,) = f.wait_ready(1)
        node, agent = f.node_ids["a"], f.agents["a"]
        pid = ready["shards"][0]["pid"]

        agent.signal(signal.SIGSTOP)
        dropped = until(lambda: next((n for n in [f.nodes()[node]] if not n["connected"]), None),
                        "the control plane to drop the frozen agent's stream", on_timeout=f.dump)
        assert dropped["state"] == "ready", dropped  # dropped by keepalive, not by the lifecycle
        epoch = dropped["epoch"]
        agent.signal(signal.SIGCONT)
        until(lambda: (n := f.nodes()[node])["connected"] and n["epoch"] > epoch,
              "the agent to register again", on_timeout=f.dump)

        epoch = f.nodes()[node]["epoch"]
        f.drop_stream(agent)
        until(lambda: (n := f.nodes()[node])["connected"] and n["epoch"] > epoch,
              "the agent to redial and register", on_timeout=f.dump)
        assert f.engine_pids() == [pid]  # engines never stop because the stream did
        (still,) = f.wait_ready(1)
        assert still["replica_id"] == ready["replica_id"]


def test_silent_node_becomes_unreachable_then_lost_and_its_replicas_are_placed_elsewhere(tmp_path):
    with Fleet(tmp_path, nodes={"a": 1, "b": 1}, replicas=1) as f:
        f.start()
        until(lambda: len(f.nodes()) == 2, "both nodes registered", on_timeout=f.dump)
        old = only_replica(f)
        silent_id = old["shards"][0]["node_id"]
        other_id = next(n for n in f.node_ids.values() if n != silent_id)
        silent = next(a for name, a in f.agents.items() if f.node_ids[name] == silent_id)
        old_pid = old["shards"][0]["pid"]
        silent.signal(signal.SIGSTOP)
        states = []

        def state_is(want: str) -> bool:
            st = f.nodes()[silent_id]["state"]
            if not states or states[-1] != st:
                states.append(st)
            return st == want

        until(lambda: state_is("unreachable"), "the silent node unreachable", on_timeout=f.dump)
        until(lambda: state_is("lost"), "the silent node lost", on_timeout=f.dump)
        assert states[-2:] == ["unreachable", "lost"]
        moved = until(lambda: next((r for r in f.ready_replicas() if r["shards"][0]["node_id"] == other_id), None),
                      "the replica placed on the other node", on_timeout=f.dump)
        assert moved["replica_id"] != old["replica_id"]
        assert "lost" in moved["last_failure"]["reason"]
        table = f.ctl("nodes").stdout
        assert any(line.startswith(silent_id) and " lost" in line for line in table.splitlines()), table
        nodes_json = json.loads(f.ctl("nodes", "-o", "json").stdout)
        assert {n["node_id"]: n["state"] for n in nodes_json["nodes"]}[silent_id] == "lost"

        # The node comes back with its old engine still running: it is surplus now and stopped.
        silent.signal(signal.SIGCONT)
        until(lambda: f.nodes()[silent_id]["state"] == "ready", "the node back", on_timeout=f.dump)
        until(lambda: f.engine_pids() == [moved["shards"][0]["pid"]], "the surplus engine stopped",
              on_timeout=f.dump)
        assert old_pid not in f.engine_pids()
        (still,) = f.wait_ready(1)
        assert still["replica_id"] == moved["replica_id"]


def test_shard_never_healthy_fails_at_start_timeout_with_the_engine_output_in_ctl_replicas(tmp_path):
    # "hang": /health answers, completions never produce a token; a /health-only
    # readiness check would call this engine ready.
    with Fleet(tmp_path, nodes={"a": 1}, replicas=1, restart={"backoff_initial": 300, "backoff_max": 300},
               profile={"start_timeout": 5, "env": {"LLMGW_SIM_FAULT": "hang"}}) as f:
        f.start()

        def failed():
            doc = f.try_get("/v1/replicas")
            reps = doc["replicas"] if doc else []
            return next((r for r in reps if r["state"] == "failed"), None)

        r = until(failed, "the replica to fail", on_timeout=f.dump)
        (s,) = r["shards"]
        assert s["state"] == "failed"
        assert "start_timeout (5s)" in s["reason"]
        assert "Starting vLLM API server" in (s["output_tail"] or "")
        assert not f.ready_replicas()
        text = f.ctl("replicas").stdout
        row = next(line for line in text.splitlines() if line.startswith(r["replica_id"]))
        assert row.split()[1:3] == ["tiny/sim", "failed"], text
        assert "not ready within start_timeout (5s)" in text
        assert "| " in text and "Starting vLLM API server" in text, text
        assert "next attempt in" in text
        doc = json.loads(f.ctl("replicas", "-o", "json").stdout)
        assert doc["replicas"][0]["shards"][0]["output_tail"] == s["output_tail"] or \
            "Starting vLLM API server" in doc["replicas"][0]["shards"][0]["output_tail"]
        explain = f.ctl("explain", "tiny").stdout
        assert "failed" in explain


def test_drained_replica_leaves_the_router_stops_and_is_replaced(tmp_path):
    with Fleet(tmp_path, nodes={"a": 2}, replicas=1) as f:
        f.start()
        old = only_replica(f)
        with f.client() as c:
            before = c.get("/v1/router/endpoints").json()
        assert [e["replica_id"] for e in before["endpoints"]] == [old["replica_id"]]
        out = f.ctl("drain", old["replica_id"]).stdout
        assert "draining" in out
        res = f.ctl("drain", old["replica_id"], check=False)
        assert res.returncode == 1 and any(s in res.stderr for s in ("already", "no replica", "neither a registered node")), res.stderr
        new = until(lambda: next((r for r in f.ready_replicas() if r["replica_id"] != old["replica_id"]), None),
                    "the replacement ready", on_timeout=f.dump)
        assert new["shards"][0]["gpus"] != old["shards"][0]["gpus"], "placed beside, not on, the draining GPUs"
        until(lambda: old["replica_id"] not in {r["replica_id"] for r in f.replicas()["replicas"]},
              "the drained replica gone", on_timeout=f.dump)
        assert f.engine_pids() == [new["shards"][0]["pid"]]
        with f.client() as c:
            after = c.get("/v1/router/endpoints").json()
        assert [(e["replica_id"], e["draining"]) for e in after["endpoints"]] == [(new["replica_id"], False)]
        assert f"{old['replica_id']}: drain requested" in f.server.output(10**7)
