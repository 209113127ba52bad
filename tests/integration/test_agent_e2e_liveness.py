"""Liveness after Ready, with real engines: the supervisor fails a shard that stopped serving.

The simulator's faults begin on SIGUSR1, after the shard is Ready, the way a
replica that served for days goes bad: its API server stops answering
(``wedge``), its engine core dies (``engine-dead``: /health 500), or the core
hangs in a collective (``hang``: /health stays 200, requests pile up and no
engine step happens).  A worker rank is judged by its process.  Short
detection times keep each test to seconds.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest

from supervisor_harness import multinode, make_spec, run

from llmgw.agent.liveness import LivenessPolicy

pytestmark = pytest.mark.integration

POLICY = LivenessPolicy(interval=0.2, timeout=0.5, fail_after=1.0, kill_after=1.0)
# A hung core still answers /health: the check must see the answer to judge by progress, so its
# timeout is not what is under test and leaves room for a loaded host.
PATIENT = LivenessPolicy(interval=0.2, timeout=3.0, fail_after=1.0, kill_after=1.0)


def fault(kind: str) -> dict:
    return {"LLMGW_SIM_FAULT": kind, "LLMGW_SIM_FAULT_ONSET": "signal"}


async def ready(h, sup, spec: dict) -> dict:
    sup.start(spec)
    await h.until(lambda: "ready" in h.states(spec["shard_id"]), f"{spec['shard_id']} ready")
    return h.last(spec["shard_id"])


async def failed_after_fault(h, sup, spec: dict) -> tuple[dict, float]:
    """Make the Ready shard's engine go bad; its failure message and the seconds it took."""
    r = await ready(h, sup, spec)
    pid = r["process"]["pid"]
    t0 = time.monotonic()
    os.kill(pid, signal.SIGUSR1)
    end = await h.terminal(spec["shard_id"])
    assert end["state"] == "failed", end
    with pytest.raises(ProcessLookupError):  # failed means gone, GPUs free
        os.kill(pid, 0)
    return end, time.monotonic() - t0


def test_a_wedged_engine_is_failed_with_the_reason(tmp_path):
    async def body(h, sup):
        end, took = await failed_after_fault(h, sup, make_spec("w.sim.1-a/r0", env=fault("wedge")))
        assert "not live: no passing health check" in end["reason"]
        assert "health: no answer within 0.5s" in end["reason"]
        assert h.states("w.sim.1-a/r0") == ["pending", "starting", "ready", "failed"]
        assert "fault wedge begins" in end["output_tail"]
        assert "failed by the agent's health check" in h.statedir.notes_path("w.sim.1-a/r0").read_text()
    run(tmp_path, body, health=POLICY)


def test_an_engine_whose_core_died_is_failed(tmp_path):
    async def body(h, sup):
        end, _ = await failed_after_fault(h, sup, make_spec("d.sim.1-a/r0", env=fault("engine-dead")))
        assert "health: HTTP 500" in end["reason"]
    run(tmp_path, body, health=POLICY)


def test_a_hung_core_with_pending_requests_is_failed_though_health_says_200(tmp_path):
    async def body(h, sup):
        spec = make_spec("h.sim.1-a/r0", env=fault("hang"))
        r = await ready(h, sup, spec)
        os.kill(r["process"]["pid"], signal.SIGUSR1)
        await h.until(lambda: "fault hang begins" in h.statedir.log_path("h.sim.1-a/r0").read_text(), "hang")

        async def pending_request():
            async with aiohttp.ClientSession() as s:
                try:
                    await s.post(f"http://127.0.0.1:{r['port']}/v1/completions",
                                 json={"model": "tiny-served", "prompt": "x", "max_tokens": 2})
                except aiohttp.ClientError:
                    pass  # cut when the engine is killed
        req = asyncio.create_task(pending_request())
        end = await h.terminal("h.sim.1-a/r0")
        req.cancel()
        assert end["state"] == "failed"
        assert "request(s) pending and no engine step" in end["reason"], end["reason"]
    run(tmp_path, body, health=PATIENT)


def test_a_busy_healthy_engine_and_an_idle_one_stay_ready(tmp_path):
    """Progress while busy and /health while idle both pass: nothing is failed over many checks."""
    async def body(h, sup):
        r = await ready(h, sup, make_spec("ok.sim.1-a/r0", env={"LLMGW_SIM_TOKEN_LATENCY": "0.05"}))
        url = f"http://127.0.0.1:{r['port']}/v1/completions"
        async with aiohttp.ClientSession() as s:
            for _ in range(3):  # each request spans several checks, streaming a token every 50 ms
                async with s.post(url, json={"model": "tiny-served", "prompt": "x", "max_tokens": 12}) as resp:
                    assert resp.status == 200
        shard = sup.shards["ok.sim.1-a/r0"]
        busy_checks = shard.checks
        assert busy_checks >= 3  # the requests spanned checks that read progress
        # idle now: checks past twice the detection time, every one passing
        await h.until(lambda: shard.checks >= busy_checks + 2 * POLICY.fail_after / POLICY.interval, "idle checks")
        assert h.states("ok.sim.1-a/r0") == ["pending", "starting", "ready"]
        assert shard.checks_failed == 0
    run(tmp_path, body, health=POLICY)


def test_a_stopped_worker_rank_is_failed_by_its_process(tmp_path):
    async def body(h, sup):
        sup.start(multinode(make_spec("mn.sim.1-x/r0"), 0))
        await h.until(lambda: "starting" in h.states("mn.sim.1-x/r0"), "rank 0 starting")
        port = h.last("mn.sim.1-x/r0")["master_port"]
        w = await ready(h, sup, multinode(make_spec("mn.sim.1-x/r1", gpus=(1,)), 1, port))
        os.kill(w["process"]["pid"], signal.SIGSTOP)
        try:
            end = await h.terminal("mn.sim.1-x/r1")
        finally:
            try:
                os.kill(w["process"]["pid"], signal.SIGCONT)
            except ProcessLookupError:
                pass
        assert end["state"] == "failed" and "process is stopped" in end["reason"]
    run(tmp_path, body, health=POLICY)
