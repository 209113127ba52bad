"""The supervisor with real engines: the simulator, launched through the real vLLM adapter.

Each test drives one ``Supervisor`` on its own event loop and watches the
``shard_status`` messages it emits, as the stream would carry them.  Every
emitted message must pass the stream schema the control plane enforces.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import stat
import sys
from pathlib import Path

import pytest
from supervisor_harness import Harness, SIM, make_spec, multinode, run

from llmgw.agent import procident
from llmgw.agent.liveness import LivenessPolicy

pytestmark = pytest.mark.integration


def test_start_reaches_ready_through_a_real_completion_and_records_identity(tmp_path):
    async def body(h, sup):
        sup.start(make_spec("tiny.sim.1-aa/r0"))
        await h.until(lambda: "ready" in h.states("tiny.sim.1-aa/r0"), "ready")
        assert h.states("tiny.sim.1-aa/r0") == ["pending", "starting", "ready"]
        ready = h.last("tiny.sim.1-aa/r0")
        pid = ready["process"]["pid"]
        assert procident.is_running(procident.ProcessIdentity.from_dict(ready["process"]))
        assert ready["address"] == "127.0.0.1" and h.config.engine_ports[0] <= ready["port"] <= h.config.engine_ports[1]
        # the engine was started in its own session (a dying agent cannot take it along)
        st = procident.read_stat(pid)
        assert st.sid == pid and st.pgid == pid
        env = procident.read_environ(pid)
        assert env["LLMGW_SHARD_ID"] == "tiny.sim.1-aa/r0" and env["LLMGW_NODE_ID"] == h.config.node_id
        assert env["CUDA_VISIBLE_DEVICES"] == "0"
        # the record holds the full spec and the identity, privately
        path = h.statedir.record_path("tiny.sim.1-aa/r0")
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        (rec,), _ = h.statedir.load()
        assert rec.spec == make_spec("tiny.sim.1-aa/r0") and rec.state == "ready"
        assert rec.process.to_dict() == ready["process"]
        # output goes to the state dir's log, the agent's launch note (with the argv) beside it,
        # and the served name came from the model
        assert "vLLM API server" in h.statedir.log_path("tiny.sim.1-aa/r0").read_text()
        assert "--served-model-name tiny-served" in h.statedir.notes_path("tiny.sim.1-aa/r0").read_text()
        await sup.stop("tiny.sim.1-aa/r0", "done")
        assert h.states("tiny.sim.1-aa/r0")[-2:] == ["draining", "stopped"]
        assert not procident.is_running(rec.process)
        assert h.statedir.load() == ([], [])
    run(tmp_path, body)


def test_healthy_engine_whose_completions_fail_is_never_ready(tmp_path):
    # /health answers 200 throughout: only a real completion tells the truth.
    async def body(h, sup):
        # A start_timeout long enough for the simulator to be serving (and failing) well before it.
        sup.start(make_spec("tiny.sim.1-bb/r0", timeout=20, env={"LLMGW_SIM_FAULT": "http-500"}))
        end = await h.terminal("tiny.sim.1-bb/r0")
        assert "ready" not in h.states("tiny.sim.1-bb/r0")
        assert end["state"] == "failed"
        assert "start_timeout (20s)" in end["reason"] and "HTTP 500" in end["reason"]
    run(tmp_path, body)


def test_hanging_engine_fails_at_start_timeout_with_its_output_tail(tmp_path):
    async def body(h, sup):
        sup.start(make_spec("tiny.sim.1-cc/r0", timeout=20, env={"LLMGW_SIM_FAULT": "hang"}))
        await h.until(lambda: "starting" in h.states("tiny.sim.1-cc/r0"), "starting")
        ident = procident.ProcessIdentity.from_dict(h.last("tiny.sim.1-cc/r0")["process"])
        end = await h.terminal("tiny.sim.1-cc/r0")
        assert end["state"] == "failed" and "not ready within start_timeout (20s)" in end["reason"]
        assert end["output_tail"].strip(), "the failure carries the engine's output"
        assert "=== llmgw-agent" not in end["output_tail"].split("\n")[0]
        assert not procident.is_running(ident), "a timed-out engine is killed, not left holding GPUs"
        assert h.statedir.load() == ([], [])
    run(tmp_path, body)


def test_slow_loading_engine_fails_at_start_timeout(tmp_path):
    async def body(h, sup):
        sup.start(make_spec("tiny.sim.1-dd/r0", timeout=3, env={"LLMGW_SIM_STARTUP_DELAY": "600"}))
        end = await h.terminal("tiny.sim.1-dd/r0")
        assert end["state"] == "failed" and "start_timeout (3s)" in end["reason"]
        assert h.states("tiny.sim.1-dd/r0") == ["pending", "starting", "failed"]
    run(tmp_path, body)


def test_exit_during_start_reports_failed_with_the_tail(tmp_path):
    async def body(h, sup):
        sup.start(make_spec("tiny.sim.1-ee/r0", env={"LLMGW_SIM_FAULT": "exit-during-start"}))
        end = await h.terminal("tiny.sim.1-ee/r0")
        assert end["state"] == "failed"
        assert end["reason"] == "engine exited with status 1 during start"
        assert "CUDA out of memory" in end["output_tail"]
    run(tmp_path, body)


def test_engine_dying_while_serving_is_reported_failed(tmp_path):
    async def body(h, sup):
        sup.start(make_spec("tiny.sim.1-ff/r0"))
        await h.until(lambda: "ready" in h.states("tiny.sim.1-ff/r0"), "ready")
        os.kill(h.last("tiny.sim.1-ff/r0")["process"]["pid"], signal.SIGKILL)
        end = await h.terminal("tiny.sim.1-ff/r0")
        assert end["state"] == "failed" and end["reason"] == "engine was killed by SIGKILL while serving"
    run(tmp_path, body)


# An engine whose group leader ignores SIGTERM (the simulator child does not,
# which is fine: only SIGKILL can end the leader).
STUBBORN = f"#!/bin/sh\ntrap '' TERM\n{' '.join(SIM)} \"$@\" &\nwhile :; do sleep 1; done\n"


def _wrapper(tmp_path: Path) -> Path:
    """An engine that, like vLLM, has a worker process in its group."""
    w = tmp_path / "engine-with-worker"
    w.write_text(f"#!/bin/sh\nsleep 100000 &\necho \"worker pid $!\"\nexec {' '.join(SIM)} \"$@\"\n")
    w.chmod(0o755)
    return w


def _blank_env_wrapper(tmp_path: Path) -> Path:
    """An engine whose worker's environment reads empty, as vLLM's do.

    vLLM names its EngineCore and worker processes with setproctitle, which
    writes over the environment block: ``/proc/<pid>/environ`` shows none of
    the agent's markers.
    """
    w = tmp_path / "engine-with-blank-worker"
    w.write_text(f"#!/bin/sh\nenv -i sleep 100000 &\necho \"worker pid $!\"\nexec {' '.join(SIM)} \"$@\"\n")
    w.chmod(0o755)
    return w


def _worker_pid(h: Harness, shard_id: str) -> int:
    m = re.search(r"worker pid (\d+)", h.statedir.log_path(shard_id).read_text())
    assert m, "wrapper did not start its worker"
    return int(m.group(1))


def test_stop_kills_the_whole_process_group(tmp_path):
    async def body(h, sup):
        sup.start(make_spec("tiny.sim.1-gg/r0"))
        await h.until(lambda: "ready" in h.states("tiny.sim.1-gg/r0"), "ready")
        worker = procident.identify(_worker_pid(h, "tiny.sim.1-gg/r0"))
        assert procident.is_running(worker)
        await sup.stop("tiny.sim.1-gg/r0", "scale down")
        assert h.last("tiny.sim.1-gg/r0")["state"] == "stopped"
        assert not procident.is_running(worker)
    run(tmp_path, body, command=(str(_wrapper(tmp_path)),))


def test_a_crashed_leaders_workers_are_killed_before_failed_is_reported(tmp_path):
    async def body(h, sup):
        sup.start(make_spec("tiny.sim.1-hh/r0"))
        await h.until(lambda: "ready" in h.states("tiny.sim.1-hh/r0"), "ready")
        worker = procident.identify(_worker_pid(h, "tiny.sim.1-hh/r0"))
        seen_alive_at_report = []
        orig = h.emit
        h.emit = lambda m: (seen_alive_at_report.append(procident.is_running(worker))
                            if m["state"] == "failed" else None, orig(m))
        sup.emit = h.emit
        os.kill(h.last("tiny.sim.1-hh/r0")["process"]["pid"], signal.SIGKILL)
        await h.terminal("tiny.sim.1-hh/r0")
        assert seen_alive_at_report == [False], "failed promises free GPUs: the worker must be gone first"
    run(tmp_path, body, command=(str(_wrapper(tmp_path)),))


def test_a_crashed_leaders_worker_without_markers_is_killed_too(tmp_path):
    """A SIGKILLed vLLM API server left its EngineCore and workers running (their environment
    blanked by setproctitle), holding the GPUs the agent then reported free."""
    async def body(h, sup):
        sup.start(make_spec("tiny.sim.1-hk/r0"))
        await h.until(lambda: "ready" in h.states("tiny.sim.1-hk/r0"), "ready")
        worker = procident.identify(_worker_pid(h, "tiny.sim.1-hk/r0"))
        assert procident.read_environ(worker.pid) == {}, "the worker must look as vLLM's do"
        os.kill(h.last("tiny.sim.1-hk/r0")["process"]["pid"], signal.SIGKILL)
        end = await h.terminal("tiny.sim.1-hk/r0")
        assert end["state"] == "failed"
        assert not procident.is_running(worker), "a worker of the dead engine outlived the failed report"
    run(tmp_path, body, command=(str(_blank_env_wrapper(tmp_path)),))


def test_engine_ignoring_sigterm_is_killed_after_the_grace(tmp_path):
    stubborn = tmp_path / "stubborn"
    stubborn.write_text(STUBBORN)
    stubborn.chmod(0o755)

    async def body(h, sup):
        sup.start(make_spec("tiny.sim.1-ii/r0"))
        await h.until(lambda: "ready" in h.states("tiny.sim.1-ii/r0"), "ready")
        leader = procident.ProcessIdentity.from_dict(h.last("tiny.sim.1-ii/r0")["process"])
        await sup.stop("tiny.sim.1-ii/r0", "scale down")
        assert not procident.is_running(leader)
        assert "engine was killed by SIGKILL; shard stopped" in h.statedir.notes_path("tiny.sim.1-ii/r0").read_text()
        assert h.last("tiny.sim.1-ii/r0")["state"] == "stopped"
    run(tmp_path, body, command=(str(stubborn),), stop_grace=1.0)


def test_stop_during_a_drain_cuts_the_drain_grace_short(tmp_path):
    stubborn = tmp_path / "stubborn"
    stubborn.write_text(STUBBORN)
    stubborn.chmod(0o755)

    async def body(h, sup):
        sup.start(make_spec("tiny.sim.1-jj/r0"))
        await h.until(lambda: "ready" in h.states("tiny.sim.1-jj/r0"), "ready")
        leader = procident.ProcessIdentity.from_dict(h.last("tiny.sim.1-jj/r0")["process"])
        drain = asyncio.ensure_future(sup.stop("tiny.sim.1-jj/r0", "drain requested", drain=True))
        await h.until(lambda: "draining" in h.states("tiny.sim.1-jj/r0"), "draining")
        assert procident.is_running(leader)  # ignores SIGTERM; the drain grace is an hour
        await sup.stop("tiny.sim.1-jj/r0", "drain took too long")
        assert not procident.is_running(leader)
        assert "engine was killed by SIGKILL; shard stopped" in h.statedir.notes_path("tiny.sim.1-jj/r0").read_text()
        assert h.states("tiny.sim.1-jj/r0")[-2:] == ["draining", "stopped"]
        await drain
    run(tmp_path, body, command=(str(stubborn),), stop_grace=1.0, drain_grace=3600.0)


# An engine that behaves as llama-server does around SIGTERM: it exits only once every open
# request has ended (its HTTP workers are joined), and its /metrics answers only when its
# scheduler does, which a stopping server never does: the request is held until the client leaves.
HOLDING_ENGINE = """#!/usr/bin/env python3
import json, signal, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

argv = sys.argv
port = int(argv[argv.index("--port") + 1])
host = argv[argv.index("--host") + 1] if "--host" in argv else "127.0.0.1"
open_requests = threading.Condition()
count = [0]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def log_message(self, *args):
        pass

    def reply(self, status, doc):
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def handle_one_request(self):
        with open_requests:
            count[0] += 1
        try:
            super().handle_one_request()
        finally:
            with open_requests:
                count[0] -= 1
                open_requests.notify_all()

    def do_GET(self):
        if self.path == "/metrics":
            print("metrics request held", flush=True)
            while self.connection.recv(1024):
                pass
            print("metrics client went away", flush=True)
        else:
            self.reply(200, {})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.reply(200, {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]})


server = ThreadingHTTPServer((host, port), Handler)
server.daemon_threads = True
signal.signal(signal.SIGTERM, lambda *a: threading.Thread(target=server.shutdown).start())
server.serve_forever()
with open_requests:
    open_requests.wait_for(lambda: count[0] == 0)
print("exiting: no request open", flush=True)
"""


def test_a_stop_ends_the_health_check_in_flight_so_the_engine_exits_on_sigterm(tmp_path):
    """A check still waiting on the engine at SIGTERM would hold an engine that joins its open
    requests before exiting until the check timed out: the stop must end the check."""
    engine = tmp_path / "holding-engine"
    engine.write_text(HOLDING_ENGINE)
    engine.chmod(0o755)
    sid = "tiny.sim.1-kk/r0"

    async def body(h, sup):
        sup.start(make_spec(sid))
        await h.until(lambda: "ready" in h.states(sid), "ready")
        await h.until(lambda: "metrics request held" in h.statedir.log_path(sid).read_text(),
                      "a health check to wait on /metrics")
        leader = procident.ProcessIdentity.from_dict(h.last(sid)["process"])
        await sup.stop(sid, "scale down")
        assert not procident.is_running(leader)
        log = h.statedir.log_path(sid).read_text()
        assert "metrics client went away" in log and "exiting: no request open" in log, log
        notes = h.statedir.notes_path(sid).read_text()
        assert "SIGKILL" not in notes, notes
        assert h.last(sid)["state"] == "stopped"
    # the check would wait a minute for /metrics; the engine gets 20 s after SIGTERM
    run(tmp_path, body, command=(sys.executable, str(engine)), stop_grace=20.0,
        health=LivenessPolicy(interval=0.2, timeout=60.0, fail_after=120.0))


def test_refusals_before_launch(tmp_path):
    async def body(h, sup):
        sup.start(make_spec("a.sim.1-x/r0", source="/nonexistent/weights/dir"))
        sup.start(make_spec("b.sim.1-x/r0", source="https://example.invalid", gpus=(1,)))  # "/" would be a mirror
        sup.start(make_spec("c.sim.1-x/r0", extra_args=["--port", "9"], gpus=(2,)))
        for sid in ("a.sim.1-x/r0", "b.sim.1-x/r0", "c.sim.1-x/r0"):
            await h.terminal(sid)
            fetched = ["fetching"] if sid.startswith("b.") else []  # a URL source goes through the fetcher
            assert h.states(sid) == ["pending", *fetched, "failed"], "nothing may be launched"
            assert "process" not in h.last(sid)
        assert "/nonexistent/weights/dir does not exist" in h.last("a.sim.1-x/r0")["reason"]
        assert h.last("b.sim.1-x/r0")["reason"].startswith("fetching https://example.invalid: URL names no file")
        assert "--port" in h.last("c.sim.1-x/r0")["reason"]
    run(tmp_path, body)


KEY = "engine-key-" + "k" * 32


def test_engine_key_reaches_the_engine_by_environment_and_the_probe_uses_it(tmp_path):
    async def body(h, sup):
        sid = "k.sim.1-x/r0"
        sup.start(make_spec(sid, api_key=KEY))
        await h.until(lambda: "ready" in h.states(sid), "ready with the key")  # the probe got in with it
        pid = h.last(sid)["process"]["pid"]
        assert procident.read_environ(pid)["VLLM_API_KEY"] == KEY
        assert KEY not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        assert KEY not in h.statedir.log_path(sid).read_text(), "the launch note and the engine's log"
        record = h.statedir.record_path(sid)
        assert stat.S_IMODE(record.stat().st_mode) == 0o600 and KEY in record.read_text()
        await sup.stop(sid, "test")
        assert not record.exists()
    run(tmp_path, body)


def test_no_key_on_a_non_loopback_bind_is_refused_before_launch(tmp_path):
    async def body(h, sup):
        sup.start(make_spec("nokey.sim.1-x/r0"))
        last = await h.terminal("nokey.sim.1-x/r0")
        assert h.states("nokey.sim.1-x/r0") == ["pending", "failed"] and "process" not in last
        assert "no engine key" in last["reason"] and "0.0.0.0" in last["reason"]
    run(tmp_path, body, bind_host="0.0.0.0")


def test_gpu_held_by_a_live_shard_is_not_handed_out_twice(tmp_path):
    async def body(h, sup):
        sup.start(make_spec("one.sim.1-x/r0", gpus=(0, 1)))
        await h.until(lambda: "starting" in h.states("one.sim.1-x/r0"), "first starting")
        sup.start(make_spec("two.sim.1-x/r0", gpus=(1,)))
        end = await h.terminal("two.sim.1-x/r0")
        assert end["state"] == "failed" and "GPU(s) [1] are held by shard(s) one.sim.1-x/r0" in end["reason"]
        assert "one.sim.1-x/r0" in {s.shard_id for s in sup.live_shards()}
    run(tmp_path, body)


def test_duplicate_start_launches_one_engine_and_stop_of_unknown_is_answered(tmp_path):
    async def body(h, sup):
        sup.start(make_spec("dup.sim.1-x/r0"))
        await h.until(lambda: "ready" in h.states("dup.sim.1-x/r0"), "ready")
        sup.start(make_spec("dup.sim.1-x/r0"))
        assert h.states("dup.sim.1-x/r0") == ["pending", "starting", "ready", "ready"]
        assert len(sup.live_shards()) == 1
        await sup.stop("never.sim.1-x/r0", "cleanup")
        assert h.last("never.sim.1-x/r0")["state"] == "stopped"
    run(tmp_path, body)


def test_stop_before_launch_reports_stopped(tmp_path):
    async def body(h, sup):
        sup.start(make_spec("early.sim.1-x/r0"))
        await sup.stop("early.sim.1-x/r0", "changed my mind")  # the lifecycle task has not run yet
        assert h.states("early.sim.1-x/r0") == ["pending", "stopped"]
        await asyncio.sleep(0.5)
        assert h.states("early.sim.1-x/r0") == ["pending", "stopped"]
        assert h.statedir.load() == ([], [])
    run(tmp_path, body)


def test_multi_node_rank0_reports_its_rendezvous_port_and_workers_are_ready_by_liveness(tmp_path):
    async def body(h, sup):
        sup.start(multinode(make_spec("mn.sim.1-x/r0"), 0))
        await h.until(lambda: "starting" in h.states("mn.sim.1-x/r0"), "rank 0 starting")
        starting = h.last("mn.sim.1-x/r0")
        lo, hi = h.config.engine_ports
        assert lo <= starting["master_port"] <= hi and starting["master_port"] != starting["port"]
        worker_spec = multinode(make_spec("mn.sim.1-x/r1", gpus=(1,)), 1, starting["master_port"])
        sup.start(worker_spec)
        await h.until(lambda: "ready" in h.states("mn.sim.1-x/r1"), "rank 1 ready")
        worker = h.last("mn.sim.1-x/r1")
        assert worker["port"] is None  # headless: serves no HTTP
        argv = h.statedir.notes_path("mn.sim.1-x/r1").read_text()
        assert "--headless" in argv and f"--master-port {starting['master_port']}" in argv
        assert f"--master-addr 127.0.0.1" in h.statedir.notes_path("mn.sim.1-x/r0").read_text()
    run(tmp_path, body)


def test_a_prefill_replica_gets_a_side_channel_port_held_across_adoption(tmp_path):
    async def body(h, sup):
        spec = make_spec("pd.sim:prefill.0-x/r0")
        spec["profile"]["kv_transfer"] = {"connector": "nixl", "role": "prefill"}
        sup.start(spec)
        await h.until(lambda: "ready" in h.states("pd.sim:prefill.0-x/r0"), "the prefill engine ready")
        shard = sup.shards["pd.sim:prefill.0-x/r0"]
        lo, hi = h.config.engine_ports
        assert lo <= shard.side_port <= hi and shard.side_port != shard.port
        argv = h.statedir.notes_path("pd.sim:prefill.0-x/r0").read_text()
        assert '"kv_role":"kv_producer"' in argv
        # an agent restarted beside the running engine holds its side channel too
        (record,), _ = h.statedir.load()
        from llmgw.agent.supervisor import Supervisor
        other = Supervisor(h.config, h.statedir, h.emit)
        adopted = other.adopt(record)
        assert adopted.side_port == shard.side_port and shard.side_port in other._ports_held()
        await other.detach()
    run(tmp_path, body)
