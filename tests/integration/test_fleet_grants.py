"""A node certificate cannot take over another model's traffic: adoption needs the control plane's grant.

The attack, through real processes: a second node certificate of the fleet CA
registers a READY shard of an invented replica of the served model, pointing
at its own HTTP server with its own engine key, over and over.  (a) Right
after a control-plane restart, before the real agent is back; (b) while the
real engine crashes.  It must be told to stop, and no prompt may reach it;
the honest engine keeps serving.  Also: a lost grant secret makes the
control plane replace engines rather than trust them, and a node presenting
another node's GPU UUIDs is refused.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import aiohttp
import httpx
import pytest

from llmgw.tls import client_context

from fleet import Fleet, register_message, simulated_inventory, until

pytestmark = pytest.mark.integration

BODY = {"model": "tiny", "prompt": "secret prompt", "max_tokens": 2}


class Trap:
    """The impostor's engine: answers 200 to anything and records every request."""

    def __init__(self) -> None:
        seen = self.seen = []

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                seen.append((self.command, self.path))
                body = json.dumps({"id": "x", "object": "text_completion", "model": "tiny",
                                   "choices": [{"index": 0, "text": "owned", "finish_reason": "stop"}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *a: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Impostor:
    """A node certificate re-registering a READY shard of an invented replica every ``every`` seconds."""

    def __init__(self, f: Fleet, node_id: str, spec: dict[str, Any], port: int, every: float = 0.5,
                 hardware: dict[str, Any] | None = None, fresh: bool = False):
        self.f, self.node_id, self.every, self.fresh = f, node_id, every, fresh
        self.cert = f.pki.node(node_id)
        self.msg = register_message(node_id, gpus=1, shards=[{
            "spec": spec, "state": "ready", "port": port, "address": "127.0.0.1", "adopted": True,
            "process": {"pid": os.getpid(), "start_time": 1, "boot_id": "impostor"}}])
        if hardware is not None:
            self.msg["hardware"] = hardware
        self.received: list[dict[str, Any]] = []
        self.registrations = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> "Impostor":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    async def _run(self) -> None:
        ctx = client_context(self.f.pki.ca_cert, *self.cert)
        url = self.f.url.replace("https", "wss") + "/v1/agent/stream"
        while not self._stop.is_set():
            try:
                if self.fresh and self.msg["shards"]:  # a new invented replica every time
                    spec = self.msg["shards"][0]["spec"]
                    rid = f"{spec['replica_id'].rsplit('-', 1)[0]}-{self.registrations:06x}"
                    self.msg["shards"][0]["spec"] = {**spec, "replica_id": rid, "shard_id": f"{rid}/r0"}
                async with aiohttp.ClientSession() as s, s.ws_connect(url, ssl=ctx) as ws:
                    await ws.send_str(json.dumps(self.msg))
                    self.registrations += 1
                    loop = asyncio.get_running_loop()
                    end = loop.time() + self.every
                    while (left := end - loop.time()) > 0:
                        try:
                            m = await ws.receive(timeout=left)
                        except asyncio.TimeoutError:
                            break
                        if m.type != aiohttp.WSMsgType.TEXT:
                            break
                        self.received.append(json.loads(m.data))
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                await asyncio.sleep(0.2)  # the control plane is down: try again, first in line

    def stops(self) -> list[dict[str, Any]]:
        return [m for m in self.received if m.get("type") == "stop"]


def real_spec(f: Fleet) -> dict[str, Any]:
    """The honest shard's spec as its agent keeps it (the catalog an attacker knows anyway)."""
    (record,) = (f.root / "a" / "state" / "shards").glob("*.json")
    return json.loads(record.read_text())["spec"]


def invented(spec: dict[str, Any]) -> dict[str, Any]:
    """A replica of the same model the control plane never placed, with the attacker's own key."""
    rid = spec["replica_id"].rsplit("-", 1)[0] + "-00beef"  # slot 0, "placed" earlier than anything real
    out = {k: v for k, v in spec.items() if k != "grant"}
    return {**out, "replica_id": rid, "shard_id": f"{rid}/r0", "api_key": "A" * 43}


def serve_through_router(f: Fleet, n: int = 10) -> None:
    for _ in range(n):
        r = httpx.post(f"{f.router_url}/v1/completions", json=BODY, verify=f.router_verify(), timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] != "owned", r.text


def rank0_pid(f: Fleet) -> tuple[str, int] | None:
    """The serving replica and its engine's pid (None while none serves)."""
    ready = f.ready_replicas()
    if len(ready) != 1:
        return None
    return ready[0]["replica_id"], ready[0]["shards"][0]["process"]["pid"]


def test_impostor_registering_first_after_a_control_plane_restart_is_refused_and_never_routed(tmp_path):
    trap = Trap()
    with Fleet(tmp_path, nodes={"a": 1}, replicas=1, router=True, lifecycle={"startup_grace": 3.0}) as f:
        f.start()
        f.wait_ready(1)
        rid, pid = rank0_pid(f)  # type: ignore[misc]
        # the agent keeps the control plane's grant with the shard record, for this node
        granted = real_spec(f)["grant"]
        assert (granted["node_id"], granted["replica_id"], granted["rank"]) == (f.node_ids["a"], rid, 0)
        evil = Impostor(f, f"evil-{f.suffix}", invented(real_spec(f)), trap.port)
        agent = f.agents["a"]
        agent.signal(signal.SIGSTOP)  # the real agent comes back only after the impostor
        try:
            f.server.kill()
            f.server.start()
            evil.start()
            f.wait_healthy()
            until(lambda: evil.registrations >= 3, "the impostor to register first", on_timeout=f.server.output)
        finally:
            agent.signal(signal.SIGCONT)
        until(lambda: rank0_pid(f) == (rid, pid), "the honest replica adopted again",
              on_timeout=f.dump)
        until(lambda: f.try_get("/v1/nodes") and f.get("/v1/nodes")["fleet"]["startup_grace_left_s"] == 0,
              "the startup grace to end")
        until(evil.stops, "the impostor to be told to stop", on_timeout=f.server.output)
        serve_through_router(f)
        # ctl says why, while the impostor keeps claiming
        until(lambda: f"on {evil.node_id}: refused: no grant" in f.ctl("replicas").stdout,
              "ctl replicas to show the refused claim")
        until(lambda: f"claimed by {evil.node_id} and not adopted" in f.ctl("explain", "tiny").stdout,
              "ctl explain to show the refused claim")
        evil.stop()
        assert rank0_pid(f) == (rid, pid), "the honest engine was neither replaced nor restarted"
        assert trap.seen == [], f"requests reached the impostor: {trap.seen}"
        assert all("no grant" in m["reason"] for m in evil.stops())
        assert "refused, not adopted" in f.server.life_output()
    trap.close()


def test_impostor_hammering_while_the_real_engine_crashes_never_gets_the_slot(tmp_path):
    trap = Trap()
    with Fleet(tmp_path, nodes={"a": 1}, replicas=1, router=True, lifecycle={"startup_grace": 1.0}) as f:
        f.start()
        f.wait_ready(1)
        rid, pid = rank0_pid(f)  # type: ignore[misc]
        evil = Impostor(f, f"evil-{f.suffix}", invented(real_spec(f)), trap.port, fresh=True).start()
        until(lambda: evil.stops(), "the impostor to be told to stop", on_timeout=f.server.output)
        os.killpg(pid, signal.SIGKILL)  # the real engine crashes
        until(lambda: (rank0_pid(f) or (rid, pid))[1] != pid, "the honest slot to be served again",
              on_timeout=f.dump)
        serve_through_router(f)
        evil.stop()
        assert f.ready_replicas()[0]["shards"][0]["node_id"] == f.node_ids["a"]
        assert trap.seen == [], f"requests reached the impostor: {trap.seen}"
        assert "refused, not adopted" in f.server.life_output()
    trap.close()


def test_a_lost_grant_secret_replaces_engines_loudly_instead_of_trusting_them(tmp_path):
    with Fleet(tmp_path, nodes={"a": 1}, replicas=1, router=True, lifecycle={"startup_grace": 2.0}) as f:
        f.start()
        f.wait_ready(1)
        rid, pid = rank0_pid(f)  # type: ignore[misc]
        f.server.kill()
        (tmp_path / "cp-state" / "grant.key").unlink()
        f.server.start()
        f.wait_healthy()
        until(lambda: (rank0_pid(f) or (rid, pid))[0] != rid, "a replacement placed and serving",
              on_timeout=f.dump)
        until(lambda: not any(p == pid for p in f.engine_pids()), "the untrusted engine stopped", on_timeout=f.dump)
        serve_through_router(f, 3)
        life = f.server.life_output()
        assert "ERROR" in life and "does not verify under this control plane's grant key" in life
        assert (tmp_path / "cp-state" / "grant.key").stat().st_mode & 0o777 == 0o600


def test_a_node_presenting_another_nodes_gpu_uuids_is_refused_naming_both(tmp_path):
    with Fleet(tmp_path, nodes={"a": 1}, replicas=0) as f:
        f.start()
        until(lambda: f.try_node("a"), "node a registered", on_timeout=f.dump)
        evil_id = f"evil-{f.suffix}"
        stolen = simulated_inventory(f.node_ids["a"], 1).to_dict()
        evil = Impostor(f, evil_id, {}, 1, hardware={**stolen, "node_id": evil_id})
        evil.msg["shards"] = []
        evil.start()
        until(lambda: any(m.get("type") == "error" for m in evil.received), "the refusal", on_timeout=f.server.output)
        evil.stop()
        (err,) = {m["reason"] for m in evil.received if m.get("type") == "error"}
        assert evil_id in err and f.node_ids["a"] in err and "GPU" in err
        assert evil_id not in f.nodes()
        assert f"node {evil_id} presents GPU UUID" in f.server.life_output()
