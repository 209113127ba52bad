"""``llmgw agent`` as a real process, over real mutual TLS, with simulator engines.

The control plane here is a small recording server written for these tests:
it speaks the stream contract (TLS 1.3, client certificate verified against
the fleet CA, CN == node id, every message checked against the stream
schema) and lets a test see exactly what the agent sent and when, and send
exactly the command it wants.  Full-fleet behaviour against the real control
plane lives in the control plane's own tests.

Engines are the simulator, launched by the agent through the real vLLM
adapter; each test runs its own copy of the simulator script so the agent's
"unknown engine" scan can only ever match that test's own processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml
from aiohttp import WSMsgType, web

from llmgw.agent import procident
from llmgw.agent.procident import ProcessIdentity
from llmgw.agent.statedir import ShardRecord, StateDir
from llmgw.config import schema_errors
from llmgw.tls import IdentityError, check_node_identity, init_ca, issue_node, issue_server, peer_identity, server_context
from llmgw.tls.files import write_pair
from tests.support.childenv import child_env
from tests.support.ports import engine_port_block, free_port

from fleet import until
from simproc import start_sim

pytestmark = pytest.mark.integration

WAIT = 120.0  # generous: a loaded 2-core machine must not turn slowness into failure
ROOT = Path(__file__).resolve().parents[2]
HARDWARE = ROOT / "tests" / "fixtures" / "hardware" / "pcie-4gpu-nvlink-pairs.yaml"
SIM_SCRIPT = Path(sys.executable).parent / "llmgw-engine-sim"




# ---------------------------------------------------------------------- PKI

@dataclass
class Pki:
    dir: Path
    ca_cert: Path
    server: tuple[Path, Path]
    ca: Any

    def node(self, node_id: str) -> tuple[Path, Path]:
        return write_pair(self.dir / f"node-{node_id}", *issue_node(self.ca, node_id))


def make_pki(root: Path, hosts=("localhost",), ips=("127.0.0.1",)) -> Pki:
    ca = init_ca(root / "ca")
    server = write_pair(root / "server", *issue_server(ca, list(hosts), list(ips)))
    return Pki(root, ca.cert_path, server, ca)


# ------------------------------------------------------- recording control plane

@dataclass
class Received:
    conn: int
    msg: dict


class RecordingControlPlane:
    """An agent-stream server that records every message and sends what a test asks."""

    def __init__(self, pki: Pki, port: int = 0, heartbeat_interval: float = 0.5,
                 on_register: Callable[[dict], None] | None = None):
        self.pki = pki
        self.port = port
        self.heartbeat_interval = heartbeat_interval
        self.on_register = on_register
        self.received: list[Received] = []
        self.invalid: list[tuple[int, str]] = []
        self.refused: list[str] = []
        self.conns: dict[int, web.WebSocketResponse] = {}
        self.opened = 0
        self.epoch = 0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"wss://127.0.0.1:{self.port}/v1/agent/stream"

    # -- server --------------------------------------------------------------
    async def _stream(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=4 << 20)
        await ws.prepare(request)
        with self._lock:
            self.opened += 1
            conn = self.opened
            self.conns[conn] = ws
        try:
            identity = peer_identity(request.transport.get_extra_info("ssl_object"))
            first = await ws.receive()
            if first.type != WSMsgType.TEXT:
                return ws
            reg = json.loads(first.data)
            errors = schema_errors(reg, "stream")
            if errors or reg.get("type") != "register":
                self.invalid.append((conn, f"{errors} {first.data[:200]}"))
                await ws.close()
                return ws
            if self.on_register:
                self.on_register(reg)
            try:
                check_node_identity(identity, reg["node_id"])
            except IdentityError as e:
                self.refused.append(e.reason)
                await ws.send_json({"type": "error", "reason": e.reason})
                await ws.close()
                return ws
            with self._lock:
                self.received.append(Received(conn, reg))
                self.epoch += 1
                epoch = self.epoch
            await ws.send_json({"type": "registered", "epoch": epoch, "heartbeat_interval": self.heartbeat_interval})
            async for m in ws:
                if m.type != WSMsgType.TEXT:
                    continue
                msg = json.loads(m.data)
                errors = schema_errors(msg, "stream")
                if errors:  # as the real control plane does: a malformed message closes its stream
                    self.invalid.append((conn, f"{errors} {m.data[:200]}"))
                    await ws.close()
                    break
                with self._lock:
                    self.received.append(Received(conn, msg))
        finally:
            with self._lock:
                self.conns.pop(conn, None)
        return ws

    def start(self) -> "RecordingControlPlane":
        ready = threading.Event()
        errors: list[BaseException] = []

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            app = web.Application()
            app.router.add_get("/v1/agent/stream", self._stream)
            self._runner = web.AppRunner(app)
            try:
                loop.run_until_complete(self._runner.setup())
                site = web.TCPSite(self._runner, "127.0.0.1", self.port,
                                   ssl_context=server_context(self.pki.ca_cert, *self.pki.server))
                loop.run_until_complete(site.start())
                self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            except BaseException as e:  # noqa: BLE001 - reported to the test thread
                errors.append(e)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        ready.wait(WAIT)
        if errors:
            raise errors[0]
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            async def close_all() -> None:
                for ws in list(self.conns.values()):
                    await ws.close()
            asyncio.run_coroutine_threadsafe(close_all(), self._loop).result(WAIT)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(WAIT)

    def __enter__(self) -> "RecordingControlPlane":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- test side -----------------------------------------------------------
    def send(self, msg: dict | str) -> None:
        """Send to the newest live connection."""
        assert self._loop is not None
        with self._lock:
            conn = max(self.conns)
            ws = self.conns[conn]
        coro = ws.send_str(msg) if isinstance(msg, str) else ws.send_json(msg)
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(WAIT)

    def messages(self, kind: str | None = None, conn_after: int = 0) -> list[Received]:
        with self._lock:
            return [r for r in self.received if r.conn > conn_after and (kind is None or r.msg["type"] == kind)]

    def dump(self) -> str:
        return "\n".join(f"[{r.conn}] {json.dumps(r.msg)[:400]}" for r in self.messages()) + f"\ninvalid: {self.invalid}"

    def wait_register(self, count: int, agent: "AgentProcess | None" = None) -> Received:
        regs = until(lambda: (lambda r: r if len(r) >= count else None)(self.messages("register")),
                     f"register #{count}", on_timeout=lambda: self.dump() + (agent.output() if agent else ""))
        return regs[count - 1]

    def wait_status(self, shard_id: str, state: str, conn_after: int = 0,
                    agent: "AgentProcess | None" = None) -> dict:
        def find():
            for r in self.messages("shard_status", conn_after):
                if r.msg["shard_id"] == shard_id and r.msg["state"] == state:
                    return r.msg
            return None
        return until(find, f"{shard_id} {state}", on_timeout=lambda: self.dump() + (agent.output() if agent else ""))


# ---------------------------------------------------------------------- agent

class AgentProcess:
    """``python -m llmgw agent --config agent.yaml``, output to a file."""

    def __init__(self, root: Path, node_id: str, url: str, pki: Pki, engine_command: list[str],
                 **overrides: Any):
        self.root = root
        self.node_id = node_id
        self.state_dir = root / "state"
        crt, key = pki.node(node_id)
        first = engine_port_block(200)
        self.config = {
            "node_id": node_id,
            "control_plane": {"url": url, "reconnect_initial": 0.2, "reconnect_max": 1.0},
            "tls": {"ca": str(pki.ca_cert), "cert": str(crt), "key": str(key)},
            "state_dir": str(self.state_dir),
            "advertise_address": "127.0.0.1",
            "engine_bind_host": "127.0.0.1",
            "engine_ports": {"first": first, "last": first + 199},
            "discovery": {"gpus": "simulated", "hardware_file": str(HARDWARE),
                          "sysfs_root": str(root / "no-sysfs")},
            "engines": {"vllm": engine_command},
            **overrides,
        }
        self.config_path = root / "agent.yaml"
        self.config_path.write_text(yaml.safe_dump(self.config))
        self.log_path = root / "agent.log"
        self.proc: subprocess.Popen | None = None
        self.lives = 0

    def start(self) -> "AgentProcess":
        self.lives += 1
        with open(self.log_path, "ab") as log:
            log.write(f"----- agent life {self.lives}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "llmgw", "--log-level", "DEBUG", "agent", "--config", str(self.config_path)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.root, env=child_env())
        return self

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(WAIT)

    def terminate(self) -> int:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(WAIT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(WAIT)
        return self.proc.returncode if self.proc else 0

    def output(self) -> str:
        try:
            return "\n--- agent output ---\n" + self.log_path.read_text(errors="replace")[-20000:]
        except FileNotFoundError:
            return ""

    def statedir(self) -> StateDir:
        return StateDir(self.state_dir)


def node_name() -> str:
    return f"node-{os.getpid()}-{random.randrange(1 << 30):x}"


def sim_copy(root: Path) -> list[str]:
    dst = root / "engine-sim"
    shutil.copy(SIM_SCRIPT, dst)
    dst.chmod(0o755)
    return [str(dst)]


def sim_with_worker(root: Path) -> list[str]:
    """An engine that, like vLLM, keeps a worker process in its group."""
    w = root / "engine-with-worker"
    w.write_text(f"#!/bin/sh\nsleep 100000 &\necho \"worker pid $!\"\nexec {SIM_SCRIPT} \"$@\"\n")
    w.chmod(0o755)
    return [str(w)]


def make_spec(shard_id: str, *, timeout: float = 120, env: dict | None = None, gpus=(0,)) -> dict:
    return {
        "shard_id": shard_id, "replica_id": shard_id.split("/")[0],
        "model": {"name": "tiny", "source": "org/tiny", "served_name": "tiny"},
        "profile": {"name": "sim", "engine": "vllm", "tensor_parallel_size": len(gpus), "pipeline_parallel_size": 1,
                    "nodes": 1, "extra_args": [], "env": env or {}, "start_timeout": timeout},
        "rank": 0, "nnodes": 1, "gpu_indices": list(gpus), "env": {},
    }


def complete(port: int) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                 data=json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=WAIT) as r:
        return json.loads(r.read())


@pytest.fixture
def pki(tmp_path):
    return make_pki(tmp_path / "pki")


@pytest.fixture
def cleanup():
    """Kill whatever a test leaves running, even when it fails half-way."""
    agents: list[AgentProcess] = []
    engines: list[ProcessIdentity] = []
    yield agents, engines
    for a in agents:
        a.terminate()
    for e in engines:
        if procident.is_same_process(e):
            try:
                os.killpg(e.pid, signal.SIGKILL)
            except OSError:
                pass


# ---------------------------------------------------------------------- tests

def test_agent_sigkilled_ten_times_adopts_the_untouched_engine_and_a_later_stop_kills_its_group(
        tmp_path, pki, cleanup):
    agents, engines = cleanup
    shard = "tiny.sim.1-k9/r0"
    with RecordingControlPlane(pki) as cp:
        agent = AgentProcess(tmp_path, node_name(), cp.url, pki, sim_with_worker(tmp_path))
        agents.append(agent)
        agent.start()
        first = cp.wait_register(1, agent)
        assert first.msg["shards"] == []
        cp.send({"type": "start", "spec": make_spec(shard)})
        ready = cp.wait_status(shard, "ready", agent=agent)
        engine = ProcessIdentity.from_dict(ready["process"])
        engines.append(engine)
        log_text = agent.statedir().log_path(shard).read_text()
        worker = procident.identify(int(re.search(r"worker pid (\d+)", log_text).group(1)))
        assert worker is not None and procident.is_running(worker)

        for life in range(2, 12):
            agent.kill()
            assert procident.is_running(engine), "SIGKILL of the agent must not touch its engine"
            assert procident.is_running(worker)
            agent.start()
            reg = cp.wait_register(life, agent).msg
            (report,) = reg["shards"]
            assert report["process"] == engine.to_dict()  # same pid, same start time, same boot
            assert report["adopted"] is True and report["state"] == "ready"
            assert report["spec"] == make_spec(shard) and report["port"] == ready["port"]
            assert complete(ready["port"])["choices"], "the adopted engine still serves"
        assert procident.is_running(engine) and procident.is_running(worker)

        last_conn = cp.wait_register(11).conn
        cp.send({"type": "stop", "shard_id": shard, "reason": "scale down"})
        stopped = cp.wait_status(shard, "stopped", conn_after=last_conn - 1, agent=agent)
        assert stopped["process"] == engine.to_dict()
        assert not procident.is_running(engine), "stop must really kill the adopted engine"
        assert not procident.is_running(worker), "...and the rest of its process group"
        assert agent.statedir().load() == ([], [])
        assert agent.statedir().notes_path(shard).read_text().count("adopted engine pid") == 10
        assert "llmgw-agent" not in agent.statedir().log_path(shard).read_text(), "notes stay out of the engine's log"
        assert agent.proc.poll() is None


def test_an_adopted_engine_that_dies_reports_its_own_last_words_not_the_agents_notes(tmp_path, pki, cleanup):
    agents, engines = cleanup
    shard = "tiny.sim.1-lw/r0"
    with RecordingControlPlane(pki) as cp:
        agent = AgentProcess(tmp_path, node_name(), cp.url, pki, sim_copy(tmp_path))
        agents.append(agent)
        agent.start()
        cp.wait_register(1, agent)
        cp.send({"type": "start", "spec": make_spec(shard, env={"LLMGW_SIM_FAULT": "crash-after:4"})})
        ready = cp.wait_status(shard, "ready", agent=agent)
        engines.append(ProcessIdentity.from_dict(ready["process"]))
        for life in range(2, 5):  # every restart adopts the engine and notes it
            agent.kill()
            agent.start()
            (report,) = cp.wait_register(life, agent).msg["shards"]
            assert report["adopted"] is True
        last_conn = cp.wait_register(4).conn
        req = urllib.request.Request(f"http://127.0.0.1:{ready['port']}/v1/completions", method="POST",
                                     data=json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 8}).encode(),
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(OSError):  # the engine dies mid-answer
            urllib.request.urlopen(req, timeout=WAIT).read()
        failed = cp.wait_status(shard, "failed", conn_after=last_conn - 1, agent=agent)
        tail = failed["output_tail"]
        assert "died unexpectedly" in tail.rstrip().splitlines()[-1], tail[-2000:]
        assert "llmgw-agent" not in tail and "adopted" not in tail, tail[-2000:]
        assert "Starting vLLM API server" in tail, "the engine's output of this life, from its start"
        assert agent.statedir().notes_path(shard).read_text().count("adopted engine pid") == 3


def test_adopted_engines_keep_their_start_deadline_and_are_watched_by_polling(tmp_path, pki, cleanup):
    agents, engines = cleanup
    loading, hanging, serving = "load.sim.1-a/r0", "hang.sim.1-a/r0", "serve.sim.1-a/r0"
    with RecordingControlPlane(pki) as cp:
        agent = AgentProcess(tmp_path, node_name(), cp.url, pki, sim_copy(tmp_path))
        agents.append(agent)
        agent.start()
        cp.wait_register(1, agent)
        cp.send({"type": "start", "spec": make_spec(serving, gpus=(2,))})
        cp.wait_status(serving, "ready", agent=agent)
        cp.send({"type": "start", "spec": make_spec(loading, env={"LLMGW_SIM_STARTUP_DELAY": "6"})})
        cp.send({"type": "start", "spec": make_spec(hanging, timeout=30, gpus=(1,), env={"LLMGW_SIM_FAULT": "hang"})})
        for sid in (loading, hanging):
            engines.append(ProcessIdentity.from_dict(cp.wait_status(sid, "starting", agent=agent)["process"]))
        deadline_before = agent.statedir().record_path(hanging).read_text()
        agent.kill()

        agent.start()
        reg = cp.wait_register(2, agent)
        reports = {r["spec"]["shard_id"]: r for r in reg.msg["shards"]}
        assert set(reports) == {loading, hanging, serving} and all(r["adopted"] for r in reports.values())
        assert reports[hanging]["state"] == "starting" and reports[loading]["state"] in ("starting", "ready")
        assert json.loads(agent.statedir().record_path(hanging).read_text())["start_deadline"] == \
            json.loads(deadline_before)["start_deadline"], "an agent restart must not grant a fresh start_timeout"
        if reports[loading]["state"] == "starting":
            cp.wait_status(loading, "ready", conn_after=reg.conn - 1, agent=agent)
        failed = cp.wait_status(hanging, "failed", conn_after=reg.conn - 1, agent=agent)
        assert "not ready within start_timeout (30s)" in failed["reason"] and failed["output_tail"].strip()
        assert not procident.is_running(engines[1])

        os.kill(reports[serving]["process"]["pid"], signal.SIGKILL)
        died = cp.wait_status(serving, "failed", conn_after=reg.conn - 1, agent=agent)
        assert "exit status unknown" in died["reason"] and died["reason"].endswith("while serving")


def test_record_whose_pid_now_belongs_to_an_unrelated_process_is_never_signalled(tmp_path, pki, cleanup):
    agents, _ = cleanup
    shard = "tiny.sim.1-re/r0"
    stranger = subprocess.Popen(["sleep", "100000"], start_new_session=True)
    try:
        real = procident.identify(stranger.pid)
        agent_root = tmp_path
        sd = StateDir(agent_root / "state")
        # What a record looks like after its engine died and the pid was reused.
        sd.write(ShardRecord(spec=make_spec(shard), state="ready",
                             process=ProcessIdentity(real.pid, real.start_time - 1, real.boot_id),
                             port=free_port(), address="127.0.0.1", started_at=time.time()))
        with RecordingControlPlane(pki) as cp:
            agent = AgentProcess(agent_root, node_name(), cp.url, pki, sim_copy(tmp_path))
            agents.append(agent)
            agent.start()
            reg = cp.wait_register(1, agent).msg
            assert reg["shards"] == [], "a record that no longer matches its process describes nothing"
            assert sd.load() == ([], [])
            # a stop for that shard must not reach the stranger either
            cp.send({"type": "stop", "shard_id": shard, "reason": "cleanup"})
            answer = cp.wait_status(shard, "stopped", agent=agent)
            assert "not running on this node" in answer["reason"]
            assert "now belongs to another process" in agent.output()
        assert stranger.poll() is None and procident.is_running(real)
        assert procident.read_stat(stranger.pid).state in ("S", "R"), "not stopped or killed"
    finally:
        stranger.kill()
        stranger.wait()


def test_engine_nothing_describes_is_killed_before_register_advertises_its_gpus(tmp_path, pki, cleanup):
    agents, _ = cleanup
    node = node_name()
    command = sim_copy(tmp_path)
    # 1: launched by an earlier agent of this node (markers set), its record lost.  (The node id
    # also keeps agents of other tests on this host away from it: to them it is another node's.)
    ghost = start_sim(model="ghost", env={"LLMGW_SHARD_ID": "ghost.sim.1-gh/r0", "LLMGW_NODE_ID": node},
                      log_dir=tmp_path)
    # 2: this node's engine command, started by hand
    port = free_port()
    by_hand = subprocess.Popen([*command, "serve", "m", "--host", "127.0.0.1", "--port", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # 3: another node's engine on the same host (a simulated fleet): not ours to kill
    other = start_sim(model="other", env={"LLMGW_SHARD_ID": "o.sim.1-o/r0", "LLMGW_NODE_ID": "some-other-node"},
                      log_dir=tmp_path)
    try:
        ids = {"ghost": procident.identify(ghost.proc.pid), "by_hand": procident.identify(by_hand.pid),
               "other": procident.identify(other.proc.pid)}
        until(lambda: procident.read_cmdline(by_hand.pid)[1:2] == command, "hand-started engine to exec")
        at_register: dict[str, bool] = {}

        def on_register(msg: dict) -> None:
            if not at_register:
                at_register.update({k: procident.is_running(v) for k, v in ids.items()})

        with RecordingControlPlane(pki, on_register=on_register) as cp:
            agent = AgentProcess(tmp_path, node, cp.url, pki, command)
            agents.append(agent)
            agent.start()
            reg = cp.wait_register(1, agent).msg
            assert at_register == {"ghost": False, "by_hand": False, "other": True}, agent.output()
            assert reg["shards"] == [] and len(reg["hardware"]["gpus"]) == 4
            out = agent.output()
            assert f"killing unidentified engine pid {ids['ghost'].pid}: launched for shard ghost.sim.1-gh/r0" in out
            assert f"killing unidentified engine pid {ids['by_hand'].pid}: runs engine command" in out
    finally:
        for p in (ghost, other):
            p.stop()
        by_hand.kill()
        by_hand.wait()


def test_start_failures_reach_the_control_plane_with_the_engines_output_tail(tmp_path, pki, cleanup):
    agents, _ = cleanup
    with RecordingControlPlane(pki) as cp:
        agent = AgentProcess(tmp_path, node_name(), cp.url, pki, sim_copy(tmp_path))
        agents.append(agent)
        agent.start()
        cp.wait_register(1, agent)
        cp.send({"type": "start", "spec": make_spec("hang.sim.1-a/r0", timeout=20, env={"LLMGW_SIM_FAULT": "hang"})})
        cp.send({"type": "start", "spec": make_spec("slow.sim.1-a/r0", timeout=3, gpus=(1,),
                                                    env={"LLMGW_SIM_STARTUP_DELAY": "600"})})
        cp.send({"type": "start", "spec": make_spec("exit.sim.1-a/r0", gpus=(2,),
                                                    env={"LLMGW_SIM_FAULT": "exit-during-start"})})
        hang = cp.wait_status("hang.sim.1-a/r0", "failed", agent=agent)
        assert "not ready within start_timeout (20s)" in hang["reason"]
        assert hang["output_tail"].strip()
        slow = cp.wait_status("slow.sim.1-a/r0", "failed", agent=agent)
        assert "not ready within start_timeout (3s)" in slow["reason"]
        exited = cp.wait_status("exit.sim.1-a/r0", "failed", agent=agent)
        assert exited["reason"] == "engine exited with status 1 during start"
        assert "CUDA out of memory" in exited["output_tail"]
        for sid in ("hang.sim.1-a/r0", "slow.sim.1-a/r0", "exit.sim.1-a/r0"):
            states = [r.msg["state"] for r in cp.messages("shard_status") if r.msg["shard_id"] == sid]
            assert states == ["pending", "starting", "failed"]
            assert not procident.is_running(ProcessIdentity.from_dict(
                [r.msg for r in cp.messages("shard_status") if r.msg["shard_id"] == sid][-1]["process"]))


def test_control_plane_restarts_never_stop_engines_and_stale_news_is_not_replayed(tmp_path, pki, cleanup):
    agents, engines = cleanup
    shard = "tiny.sim.1-cp/r0"
    cp1 = RecordingControlPlane(pki).start()
    port = cp1.port
    agent = AgentProcess(tmp_path, node_name(), cp1.url, pki, sim_copy(tmp_path))
    agents.append(agent)
    agent.start()
    cp1.wait_register(1, agent)
    cp1.send({"type": "start", "spec": make_spec(shard)})
    ready = cp1.wait_status(shard, "ready", agent=agent)
    engine = ProcessIdentity.from_dict(ready["process"])
    engines.append(engine)
    cp1.stop()

    # The control plane is away: the engine keeps serving, the agent keeps trying.
    assert complete(ready["port"])["choices"]
    with RecordingControlPlane(pki, port=port) as cp2:
        reg = cp2.wait_register(1, agent).msg
        (report,) = reg["shards"]
        assert report["process"] == engine.to_dict() and report["state"] == "ready"
        assert report["adopted"] is False  # same agent, its own child
    assert procident.is_running(engine)

    # While nobody listens the engine dies; the news is not queued for later.
    os.kill(engine.pid, signal.SIGKILL)
    until(lambda: agent.statedir().load() == ([], []), "the agent to notice the engine's death", on_timeout=agent.output)
    with RecordingControlPlane(pki, port=port) as cp3:
        reg = cp3.wait_register(1, agent)
        assert reg.msg["shards"] == [], "an empty report is the news"
        until(lambda: len(cp3.messages("heartbeat")) >= 3, "three heartbeats", on_timeout=cp3.dump)
        assert cp3.messages("shard_status") == [], "a stale transition must not follow the register"
        seqs = [r.msg["seq"] for r in cp3.messages("heartbeat")]
        assert seqs == sorted(seqs) and seqs[0] == 0
    assert agent.proc.poll() is None


def test_invalid_control_plane_messages_are_ignored_without_dropping_the_stream(tmp_path, pki, cleanup):
    agents, _ = cleanup
    with RecordingControlPlane(pki) as cp:
        agent = AgentProcess(tmp_path, node_name(), cp.url, pki, sim_copy(tmp_path))
        agents.append(agent)
        agent.start()
        conn = cp.wait_register(1, agent).conn
        cp.send("this is not json")
        cp.send({"type": "reboot"})
        cp.send({"type": "start", "spec": {"shard_id": "x/r0"}})  # fails the schema
        cp.send({"type": "heartbeat", "seq": 1})  # an up-only type
        cp.send({"type": "stop", "shard_id": "gone.sim.1-z/r0", "reason": "tidy"})
        answer = cp.wait_status("gone.sim.1-z/r0", "stopped", agent=agent)
        assert "not running on this node" in answer["reason"]
        assert cp.opened == 1 and all(r.conn == conn for r in cp.messages())
        assert not [r for r in cp.messages("shard_status") if r.msg["shard_id"] == "x/r0"]
        out = agent.output()
        assert "not JSON" in out and "'reboot'" in out and "'heartbeat' is not sent to agents" in out


def test_agent_refuses_a_server_certificate_without_the_dialed_ip(tmp_path, cleanup):
    agents, _ = cleanup
    pki = make_pki(tmp_path / "pki", hosts=("localhost",), ips=())
    with RecordingControlPlane(pki) as cp:
        agent = AgentProcess(tmp_path, node_name(), cp.url, pki, sim_copy(tmp_path))
        agents.append(agent)
        agent.start()
        until(lambda: agent.output().count("reconnecting to") >= 3, "three refused attempts", on_timeout=agent.output)
        assert "IP address mismatch" in agent.output() or "certificate verify failed" in agent.output()
        assert cp.messages() == [] and agent.proc.poll() is None


def test_config_errors_are_all_listed_and_exit_non_zero(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"node_id": "Bad_Node", "control_plane": {"url": "http://x"},
                                   "stat_dir": "/tmp/x"}))
    r = subprocess.run([sys.executable, "-m", "llmgw", "agent", "--config", str(bad)],
                       capture_output=True, text=True, timeout=WAIT)
    assert r.returncode != 0
    for pointer in ("/node_id", "/control_plane/url", "/stat_dir", "state_dir"):
        assert pointer in r.stderr, r.stderr

    missing = tmp_path / "missing.yaml"
    missing.write_text(yaml.safe_dump({
        "node_id": "n1", "control_plane": {"url": "wss://127.0.0.1:1/v1/agent/stream"},
        "tls": {"ca": str(tmp_path / "ca.crt"), "cert": str(tmp_path / "n.crt"), "key": str(tmp_path / "n.key")},
        "state_dir": str(tmp_path / "state"),
        "discovery": {"gpus": "simulated", "hardware_file": str(tmp_path / "nope.yaml")}}))
    r = subprocess.run([sys.executable, "-m", "llmgw", "agent", "--config", str(missing)],
                       capture_output=True, text=True, timeout=WAIT)
    assert r.returncode == 2
    for what in ("tls.ca", "tls.cert", "tls.key", "discovery.hardware_file"):
        assert what in r.stderr, r.stderr
