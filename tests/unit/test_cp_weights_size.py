"""The control plane learns the size of weights behind a URL and places (or refuses) by it.

Real HTTP servers on loopback answer the probes; the control plane runs its
own loop, so the probe is seen happening off the reconcile pass.
"""

from __future__ import annotations

import asyncio
import http.server
import logging
import threading
from typing import Any

import pytest

from llmgw.catalog import Model, weights_size
from llmgw.controlplane import views
from llmgw.controlplane.reconciler import Context, NodeView, Reconciler
from llmgw.controlplane.lifecycle import NodeState
from llmgw.controlplane.state import ControlPlane
from llmgw.hardware.types import GPU, HardwareInventory
from llmgw.settings import RestartPolicy, parse_server_settings
from llmgw.weightprobe import measure_sources, probe_remote_size, remote_weights_bytes
from tests.support.polling import until_async

GIB = 1 << 30
BIG = 100 * GIB  # more than the 80 GiB GPU below, whatever the headroom


class Handler(http.server.BaseHTTPRequestHandler):
    """Per path: how the server answers a HEAD and a ranged GET."""

    protocol_version = "HTTP/1.1"
    release = threading.Event()
    seen: list[tuple[str, str, str | None]] = []

    def _reply(self, status: int, headers: dict[str, str], body: bytes = b"") -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        if "Content-Length" not in headers:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self):  # noqa: N802
        self.seen.append(("HEAD", self.path, None))
        if self.path == "/big.gguf":
            self._reply(200, {"Content-Length": str(BIG)})
        elif self.path == "/slow.gguf":
            self.release.wait(60)
            self._reply(200, {"Content-Length": str(BIG)})
        elif self.path in ("/nohead.gguf", "/norange-nohead.gguf", "/star.gguf"):
            self._reply(405, {})
        elif self.path == "/nolength.gguf":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
        else:
            self._reply(404, {})

    def do_GET(self):  # noqa: N802
        rng = self.headers.get("Range")
        self.seen.append(("GET", self.path, rng))
        if self.path in ("/nohead.gguf", "/nolength.gguf") and rng == "bytes=0-0":
            self._reply(206, {"Content-Range": f"bytes 0-0/{BIG}"}, b"G")
        elif self.path == "/star.gguf":
            self._reply(206, {"Content-Range": "bytes 0-0/*"}, b"G")
        elif self.path == "/norange-nohead.gguf":
            # Ignores the range: announces the whole length and starts sending.
            self.send_response(200)
            self.send_header("Content-Length", str(BIG))
            self.end_headers()
            try:
                self.wfile.write(b"\0" * 65536)
            except OSError:
                pass
        else:
            self._reply(404, {})

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    Handler.release = threading.Event()
    Handler.seen = []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    Handler.release.set()
    srv.shutdown()
    srv.server_close()


# ------------------------------------------------------------------ the probe

def test_probe_falls_back_to_a_ranged_get_when_head_is_refused_or_says_nothing(server):
    assert probe_remote_size(f"{server}/big.gguf") == (BIG, None)
    assert probe_remote_size(f"{server}/nohead.gguf") == (BIG, None)
    assert ("GET", "/nohead.gguf", "bytes=0-0") in Handler.seen
    assert probe_remote_size(f"{server}/nolength.gguf") == (BIG, None)
    # A server that ignores the range: its Content-Length says it, the body is not read.
    assert remote_weights_bytes(f"{server}/norange-nohead.gguf") == BIG
    size, why = probe_remote_size(f"{server}/star.gguf")
    assert size is None and "HEAD answered 405" in why and "Content-Range" in why
    size, why = probe_remote_size(f"{server}/missing.gguf")
    assert size is None and why == "HEAD answered 404; GET bytes=0-0 answered 404"


def test_measure_sources_reports_why_a_url_could_not_be_sized(server):
    models = [Model("a", f"{server}/nohead.gguf", "a"), Model("b", f"{server}/missing.gguf", "b"),
              Model("c", f"{server}/big.gguf", "c", size_bytes=5)]
    failures: dict[str, str] = {}
    assert measure_sources(models, remote=True, failures=failures) == {f"{server}/nohead.gguf": BIG}
    assert list(failures) == [f"{server}/missing.gguf"] and "404" in failures[f"{server}/missing.gguf"]


def test_weights_size_says_where_the_size_came_from():
    url = "https://h/m.gguf"
    assert weights_size(Model("m", url, "m", size_bytes=7), {url: 9}) == (7, "declared")
    assert weights_size(Model("m", url, "m"), {url: 9}) == (9, "measured from URL")
    assert weights_size(Model("m", url, "m"), {url: 9}, {url: "reported by agent n1 while downloading"}) == (
        9, "reported by agent n1 while downloading")
    assert weights_size(Model("m", url, "m")) == (None, "unknown")


# ---------------------------------------------------------- the reconciler

def inventory(node_id: str = "n1") -> HardwareInventory:
    return HardwareInventory(node_id=node_id, gpu_source="simulated",
                             gpus=(GPU(0, "GPU-0", "Sim", 80 * GIB, "00000000:01:00.0"),))


def settings(source: str, **model: Any):
    return parse_server_settings({
        "api": {"listen": {"port": 8443}},
        "insecure_no_tls": True,
        "lifecycle": {"heartbeat_interval": 1, "keepalive_interval": 1, "unreachable_after": 3,
                      "lost_after": 6, "startup_grace": 0},
        "restart": {"backoff_initial": 0.1, "backoff_max": 0.2},
        "models": [{"name": "big", "source": source, **model}],
        "profiles": [{"name": "sim", "engine": "vllm"}],
        "deployments": [{"model": "big", "profile": "sim", "replicas": 1}],
    })


def test_reconciler_checks_memory_against_a_learned_size_and_waits_while_it_is_probed():
    url = "https://weights.example/big.gguf"
    cat = settings(url).catalog
    nodes = {"n1": NodeView("n1", NodeState.READY, True, 1, inventory())}
    restart = RestartPolicy()

    plan = Reconciler().reconcile(cat, nodes, 0.0, Context(restart=restart, sizing=frozenset({url})))
    assert not plan.actions
    assert plan.unplaced[("big/sim", 0)] == f"waiting for the size of {url} (probing the URL)"

    plan = Reconciler().reconcile(cat, nodes, 0.0, Context(restart=restart, weight_sizes={url: BIG}))
    assert not plan.actions
    assert "GPU memory too small" in plan.unplaced[("big/sim", 0)]

    plan = Reconciler().reconcile(cat, nodes, 0.0, Context(restart=restart, weight_sizes={url: 10 * GIB}))
    (start,) = plan.actions
    assert start.node_id == "n1" and "memory: needs 12.0 GiB" in plan.events[0]

    # Unknown and not being probed: placed as before, without a memory check.
    plan = Reconciler().reconcile(cat, nodes, 0.0, Context(restart=restart))
    assert len(plan.actions) == 1


# ---------------------------------------------------------- the control plane

class Session:
    def __init__(self) -> None:
        self.epoch = 0
        self.sent: list[dict[str, Any]] = []

    def send(self, msg: dict[str, Any]) -> bool:
        self.sent.append(msg)
        return True

    def close(self, reason: str) -> None:
        pass


def register_msg(node_id: str = "n1") -> dict[str, Any]:
    return {"type": "register", "node_id": node_id, "agent_version": "t", "boot_id": "b", "address": "10.0.0.9",
            "hardware": inventory(node_id).to_dict(), "shards": []}


def run_cp(cp: ControlPlane, body):
    async def main():
        loop_task = asyncio.create_task(cp.run(interval=0.05))
        try:
            return await body()
        finally:
            loop_task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await loop_task
    return asyncio.run(main())


def test_control_plane_probes_off_its_loop_then_refuses_and_explains_with_the_measured_size(server):
    url = f"{server}/slow.gguf"
    cp = ControlPlane(settings(url))
    session = Session()
    cp.register(register_msg(), session)

    async def body():
        # The HEAD is held by the server: the loop keeps ticking and holds the model.
        held = await until_async(lambda: cp.unplaced.get(("big/sim", 0)), "the model to wait for its size")
        assert held == f"waiting for the size of {url} (probing the URL)"
        text = views.explain_view(cp, "big")["replicas"][0]["text"]
        assert f"weights: size unknown yet (probing {url})" in text
        Handler.release.set()
        why = await until_async(lambda: "memory" in cp.unplaced.get(("big/sim", 0), "")
                               and cp.unplaced[("big/sim", 0)], "the memory refusal")
        assert why.startswith("no placement for big/sim") and "GPU memory too small" in why
        return views.explain_view(cp, "big")

    out = run_cp(cp, body)
    assert not [m for m in session.sent if m["type"] == "start"], "nothing was launched"
    (item,) = out["replicas"]
    assert item["placed"] is False and item["weights"] == {"bytes": BIG, "source": "measured from URL"}
    assert "GPU memory too small: needs 120.0 GiB (weights 100.0 GiB + 20% headroom)" in item["text"]
    assert "weights: 100.0 GiB (measured from URL)" in item["text"]
    model = views.catalog_view(cp)["models"][0]
    assert model["weights"] == {"bytes": BIG, "source": "measured from URL"}
    assert ("HEAD", "/slow.gguf", None) in Handler.seen


def test_a_failed_probe_is_logged_once_and_an_agents_download_total_fills_in(server, caplog):
    url = f"{server}/missing.gguf"
    cp = ControlPlane(settings(url))
    session = Session()
    epoch = cp.register(register_msg(), session)
    caplog.set_level(logging.DEBUG, logger="llmgw.controlplane")

    async def body():
        await until_async(lambda: url in cp.sizes.warned, "the probe to fail")
        # Unknown size and no probe running: placed without a memory check, as before.
        (start,) = await until_async(lambda: [m for m in session.sent if m["type"] == "start"], "a start")
        sid = start["spec"]["shard_id"]
        text = views.explain_view(cp, "big")["replicas"][0]["text"]
        assert "running as" in text
        # A reload with the same source probes again; the same failure is not logged again.
        cp.apply_settings(settings(url), None)
        await until_async(lambda: cp.sizes.sized_for is cp.loaded and url not in cp.sizes.probing, "the second probe")
        # The agent downloading it reports the total: from now on placement checks against it.
        assert cp.message("n1", epoch, {"type": "progress", "source": url, "file": "missing.gguf",
                                        "bytes_done": 1, "bytes_total": BIG, "rate_bps": None, "shard_ids": [sid]})
        assert cp.sizes.describe(cp.catalog.models["big"]) == {
            "bytes": BIG, "source": "reported by agent n1 while downloading"}
        cp.message("n1", epoch, {"type": "shard_status", "shard_id": sid, "state": "failed", "reason": "boom"})
        return await until_async(lambda: "memory" in cp.unplaced.get(("big/sim", 0), "")
                                and cp.unplaced[("big/sim", 0)], "the replacement to be refused")

    why = run_cp(cp, body)
    assert "GPU memory too small" in why
    assert len([m for m in session.sent if m["type"] == "start"]) == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "cannot tell the size" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "HEAD answered 404" in warnings[0].getMessage() and "declare size_bytes" in warnings[0].getMessage()
    item = views.explain_view(cp, "big")["replicas"][0]
    assert "weights: 100.0 GiB (reported by agent n1 while downloading)" in item["text"]


def test_declared_size_needs_no_probe(server):
    url = f"{server}/big.gguf"
    cp = ControlPlane(settings(url, size_bytes=GIB))
    session = Session()
    cp.register(register_msg(), session)

    async def body():
        return await until_async(lambda: [m for m in session.sent if m["type"] == "start"], "a start")

    run_cp(cp, body)
    assert not Handler.seen and not cp.sizes.probing
    out = views.explain_view(cp, "big")
    assert out["replicas"][0]["placed"] is True
    cp.reconciler.book.replicas.clear()
    (item,) = views.explain_view(cp, "big")["replicas"]
    assert "weights: 1.0 GiB (declared)" in item["text"]
