"""The control plane restarting, with real agents and engines that keep running.

The control plane persists nothing dynamic; everything it knows after a
restart comes from what agents report.  These tests prove that a restart
costs the fleet nothing: no engine restarted, none orphaned, no GPU handed
out twice, and no live node declared lost.
"""

from __future__ import annotations

import signal
import time

import httpx
import openai
import pytest

from fleet import (Fleet, gpu_owners, process_start_time, router_endpoints, shard_identities,
                   standalone_router, until)
from openai_load import LOAD_PROFILE, StreamingLoad
from tests.support import procfs

pytestmark = pytest.mark.integration


def engine_gpus(pid: int) -> tuple[str, str] | None:
    """(node id, CUDA_VISIBLE_DEVICES) from an engine's own environment."""
    env = procfs.environ(pid)
    if env is None:
        return None
    return env.get("LLMGW_NODE_ID", "?"), env.get("CUDA_VISIBLE_DEVICES", "?")


def test_control_plane_sigkilled_under_streaming_load_restarts_no_engine(tmp_path):
    with Fleet(tmp_path, nodes={"a": 2, "b": 1}, replicas=3, router=True, profile=LOAD_PROFILE,
               lifecycle={"startup_grace": 6.0}) as f:
        f.start()
        before_doc = {"replicas": f.wait_ready(3)}
        before = shard_identities(before_doc)
        assert len(before) == 3
        for node, pid, start in before.values():
            assert process_start_time(pid) == start, "the reported identity is the live process's"
        router, rport = standalone_router(f)
        until(lambda: router_endpoints(rport) == 3, "the standalone router to learn 3 endpoints",
              on_timeout=router.output)

        load = StreamingLoad(f"http://127.0.0.1:{rport}").start()
        until(lambda: load.count() >= 5, "streams flowing before the kill", on_timeout=router.output)
        f.server.kill()  # SIGKILL: no goodbye to anyone
        killed_at = load.count()
        for a in f.agents.values():
            until(lambda a=a: "stream closed" in a.life_output(), f"{a.name} to notice", on_timeout=a.output)
        until(lambda: load.count() >= killed_at + 5, "streams served while the control plane is down",
              on_timeout=router.output)
        f.server.start()
        f.wait_healthy()
        after_doc = {"replicas": f.wait_ready(3, extra=lambda rs: all(
            s.get("process") for r in rs for s in r["shards"]))}
        until(lambda: f.try_get("/v1/nodes") and f.get("/v1/nodes")["fleet"]["startup_grace_left_s"] == 0,
              "the startup grace to end")
        # Past the grace the reconciler acts freely: still nothing to do.
        after_doc = {"replicas": f.wait_ready(3)}
        until(lambda: router_endpoints(rport) == 3, "the router to follow the new control plane",
              on_timeout=router.output)
        resumed_at = load.count()
        until(lambda: load.count() >= resumed_at + 5, "streams after the restart", on_timeout=router.output)
        load.stop()

        assert load.failures == [], load.failures[:10]
        after = shard_identities(after_doc)
        assert after == before, "0 engines restarted: same shards, same pid and start time"
        assert all(s["adopted"] for r in after_doc["replicas"] for s in r["shards"])
        assert sorted(r["replica_id"] for r in after_doc["replicas"]) == sorted(
            r["replica_id"] for r in before_doc["replicas"])
        assert sorted(f.engine_pids()) == sorted(pid for _, pid, _ in after.values()), "0 orphaned engines"
        doc = f.replicas()
        assert all(len(v) == 1 for v in gpu_owners(doc).values()), gpu_owners(doc)
        assert all(n["gpus_free"] == 0 for n in f.nodes().values()), "adopted engines' GPUs are reclaimed"
        seen: set[tuple[str, str]] = set()
        for pid in f.engine_pids():
            node_gpus = engine_gpus(pid)
            assert node_gpus is not None and node_gpus not in seen, f"GPU {node_gpus} handed out twice"
            seen.add(node_gpus)
        life2 = f.server.life_output()
        assert ": placed (" not in life2 and "stopping" not in life2, life2[-5000:]
        assert "rebuilt from" in life2
        # The in-process router of the new control plane serves too.
        r = httpx.post(f"{f.router_url}/v1/completions", verify=f.router_verify(),
                       json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"]


def test_restarted_control_plane_does_not_declare_live_nodes_lost(tmp_path):
    # The grace is longer than lost_after, so silence alone would be enough
    # to declare a node lost; right after a start it must not be.
    with Fleet(tmp_path, nodes={"a": 1, "b": 1, "c": 1}, replicas=2,
               lifecycle={"startup_grace": 20.0, "unreachable_after": 2.0, "lost_after": 4.0}) as f:
        f.start()
        ready = f.wait_ready(2)
        before = shard_identities({"replicas": ready})
        busy = sorted({node for node, _, _ in before.values()})
        by_id = {f.node_ids[name]: a for name, a in f.agents.items()}
        across, after_register = by_id[busy[0]], by_id[busy[1]]
        # One agent is silent across the restart: the new control plane has never heard of it.
        across.signal(signal.SIGSTOP)
        f.server.kill()
        f.server.start()
        f.wait_healthy()
        # The other registers, then falls silent: known, then unreachable, then past lost_after.
        until(lambda: f.nodes().get(busy[1], {}).get("connected"), f"{busy[1]} to register",
              on_timeout=f.dump)
        after_register.signal(signal.SIGSTOP)
        silent_since = time.monotonic()
        until(lambda: f.nodes()[busy[1]]["state"] == "unreachable", f"{busy[1]} unreachable", on_timeout=f.dump)
        until(lambda: time.monotonic() - silent_since > 4.0 + 1.0 and f.try_get("/v1/nodes"),
              "lost_after to pass in silence", interval=0.2)
        nodes = f.get("/v1/nodes")
        assert nodes["fleet"]["startup_grace_left_s"] > 0, "the check must happen inside the grace"
        assert {n["node_id"]: n["state"] for n in nodes["nodes"]}[busy[1]] == "unreachable"
        assert busy[0] not in {n["node_id"] for n in nodes["nodes"]}
        assert "startup_grace" in (nodes["fleet"]["hold_reason"] or ""), nodes["fleet"]
        across.signal(signal.SIGCONT)
        after_register.signal(signal.SIGCONT)
        after = f.wait_ready(2, extra=lambda rs: shard_identities({"replicas": rs}) == before)
        assert sorted(r["replica_id"] for r in after) == sorted(r["replica_id"] for r in ready)
        until(lambda: f.get("/v1/nodes")["fleet"]["startup_grace_left_s"] == 0, "the grace to end")
        assert shard_identities(f.replicas()) == before
        assert all(n["state"] == "ready" and n["connected"] for n in f.nodes().values())
        life2 = f.server.life_output()
        assert "-> lost" not in life2, life2[-4000:]
        assert ": placed (" not in life2, "nothing was placed while live nodes were still to report"
        assert f"not declaring {busy[1]} lost" in life2


def test_builtin_router_answers_503_with_retry_after_not_404_until_agents_report_after_a_restart(tmp_path):
    # OpenAI clients retry a 503 (honouring Retry-After) and give up on a 404: right after a
    # restart the built-in router's table is empty only because no agent has reported yet.
    with Fleet(tmp_path, nodes={"a": 1}, replicas=1, router=True, router_http=True,
               lifecycle={"startup_grace": 30.0}) as f:
        f.start()
        f.wait_ready(1)
        url = f"http://127.0.0.1:{f.router_port}/v1/chat/completions"
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(url, json=body, timeout=60).status_code == 200
        agent = f.agents["a"]
        agent.signal(signal.SIGSTOP)  # silent across the restart: the new control plane knows no replica
        # the restarted control plane's grace only has to outlast the test's own steps (nothing waits for
        # it to end): long, so a loaded host's slow re-registration still lands inside it
        f.config["lifecycle"]["startup_grace"] = 120.0
        f.write_config()
        try:
            f.server.kill()
            f.server.start()
            f.wait_healthy()
            until(lambda: _listening(f.router_port), "the new built-in router to listen")
            assert f.get("/v1/nodes")["fleet"]["startup_grace_left_s"] > 0, "the check must happen inside the grace"
            r = httpx.post(url, json=body, timeout=60)
            assert r.status_code == 503, r.text
            assert 1 <= int(r.headers["Retry-After"]) <= 120, r.headers
            err = r.json()["error"]
            assert err["type"] == "server_error" and err["code"] == "model_not_ready", err
            got = httpx.get(f"http://127.0.0.1:{f.router_port}/v1/models/tiny", timeout=60)
            assert got.status_code == 503 and "Retry-After" in got.headers
            # a model the catalog does not serve is still "does not exist", at once
            other = httpx.post(url, json={**body, "model": "no-such-model"}, timeout=60)
            assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
        finally:
            agent.signal(signal.SIGCONT)
        # The official client retries the 503 until the agent has re-registered its engine.
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{f.router_port}/v1", api_key="unused",
                               max_retries=10, timeout=60)
        out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=2)
        assert out.choices and out.choices[0].message.content
        assert f.get("/v1/nodes")["fleet"]["startup_grace_left_s"] > 0, "served before the grace ended"


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_stopping_control_plane_answers_the_routers_held_watch_at_once(tmp_path):
    """A watch poll is held for up to 30 s when nothing changes, and SIGTERM's stop waits for every
    request in flight: the stop answers the poll 503 at once, the router keeps its endpoints and
    asks again, and the restart is not held back by its routers (nor the API closed to agents meanwhile)."""
    with Fleet(tmp_path, nodes={"a": 1}, replicas=1, lifecycle={"startup_grace": 1.0}) as f:
        f.start()
        f.wait_ready(1)
        until(lambda: f.get("/v1/nodes")["fleet"]["startup_grace_left_s"] == 0, "the startup grace to end")
        router, rport = standalone_router(f)
        until(lambda: router_endpoints(rport) == 1, "the standalone router to learn the endpoint",
              on_timeout=router.output)
        f.server.terminate()
        assert f.server.proc.returncode == 0, f.server.output()
        until(lambda: "control plane stopping" in router.output(), "the held poll to be answered",
              on_timeout=router.output)
        assert router_endpoints(rport) == 1, "a stopping control plane empties no router"


def test_a_cordon_survives_a_control_plane_crash_and_nothing_new_lands_there(tmp_path):
    """A node under maintenance stays cordoned through a control-plane crash (state_dir)."""
    with Fleet(tmp_path, nodes={"a": 1, "b": 1}, replicas=1, lifecycle={"startup_grace": 2.0}) as f:
        f.config["state_dir"] = str(tmp_path / "cp-state")
        f.write_config()
        f.start()
        (replica,) = f.wait_ready(1)
        busy = replica["shards"][0]["node_id"]
        (idle,) = [n for n in f.node_ids.values() if n != busy]
        assert "cordoned" in f.ctl("cordon", idle).stdout
        f.server.kill()  # SIGKILL: nothing is written on the way out
        f.config["deployments"][0]["replicas"] = 2  # the only room for a second replica is the cordoned node
        f.write_config()
        f.server.start()
        f.wait_healthy()
        until(lambda: len(f.nodes()) == 2 and all(n["connected"] for n in f.nodes().values()),
              "both agents to re-register", on_timeout=f.dump)
        until(lambda: f.get("/v1/nodes")["fleet"]["startup_grace_left_s"] == 0, "the startup grace to end")
        assert f"{idle}: cordoned" in f.ctl("nodes").stdout
        until(lambda: any("not schedulable" in u["reason"] for u in f.replicas()["unplaced"]),
              "the second replica to be held back by the cordon", on_timeout=f.dump)
        assert [r["shards"][0]["node_id"] for r in f.replicas()["replicas"]] == [busy]
        assert not any(n == idle for n, _ in filter(None, map(engine_gpus, f.engine_pids())))
        assert "schedulable" in f.ctl("uncordon", idle).stdout
        f.wait_ready(2)  # and lifting it works as before
