"""A standalone router fed by the control plane's watch API over mutual TLS: drain, outage."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.request

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from llmgw.router.endpoints import Endpoint
from router_support import ControlPlane, RouterProcess, openai_client, router_doc, start_sims

from tests.support.polling import until

pytestmark = pytest.mark.integration

MSG = [{"role": "user", "content": "hello"}]


def healthz(r):
    return json.loads(r.get("/healthz"))


def engine_requests(sim) -> float:
    """Requests the engine admitted: finished (any reason), running or waiting, from its own /metrics."""
    with urllib.request.urlopen(sim.url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    names = ("vllm:request_success_total", "vllm:num_requests_running", "vllm:num_requests_waiting")
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name in names)


def active_streams(r) -> dict[str, float] | None:
    """Streams being relayed per endpoint, from one scrape (so the numbers belong together)."""
    out = {"a": 0.0, "b": 0.0}
    for fam in r.metrics():
        for s in fam.samples:
            if s.name == "llmgw_router_active_streams" and s.labels.get("endpoint") in out:
                out[s.labels["endpoint"]] += s.value
    return out


def test_drained_endpoint_finishes_its_streams_and_gets_nothing_new(tmp_path):
    # The drain waits until all six streams are relaying (past their first token). A stream the
    # router has routed but whose first token has not arrived yet shows in no router metric
    # (attempts are counted when they end, active streams from the first token on), so a drain
    # landing in that window would leave unknown how many streams endpoint a really holds.
    n_tokens = 80  # 4 s per stream at 50 ms/token: all six are in flight together with room to spare
    env = {"LLMGW_SIM_TOKEN_LATENCY": "0.05", "LLMGW_SIM_OUTPUT_TOKENS": str(n_tokens)}
    a, b = start_sims(2, env=env)
    cp = ControlPlane(tmp_path)
    try:
        cp.table.replace([Endpoint("a", "m", a.url), Endpoint("b", "m", b.url)])
        with RouterProcess(router_doc(control_plane=cp.router_config()), tmp=tmp_path) as r:
            until(lambda: healthz(r)["endpoints"] == 2, "the router to learn both endpoints", 60, interval=0.05)
            results: list[int] = []
            lock = threading.Lock()

            def stream():
                with openai_client(r) as c:
                    n = sum(1 for ev in c.chat.completions.create(model="m", messages=MSG, stream=True)
                            if ev.choices and ev.choices[0].delta.content)
                with lock:
                    results.append(n)

            threads = [threading.Thread(target=stream) for _ in range(6)]
            for t in threads:
                t.start()

            def all_six_relaying():
                act = active_streams(r)
                return act if act["a"] + act["b"] == 6 and act["a"] >= 1 else None

            on_a = int(until(all_six_relaying, "all six streams relaying, some from endpoint a", 60, interval=0.05)["a"])
            rev = healthz(r)["revision"]
            cp.table.replace([Endpoint("a", "m", a.url, draining=True), Endpoint("b", "m", b.url)])
            until(lambda: healthz(r)["revision"] > rev, "the router to see the drain", 60, interval=0.05)
            # a still holds as many streams as b: without the drain, least-outstanding would send it
            # about half of these
            c = openai_client(r)
            for _ in range(8):
                assert c.chat.completions.create(model="m", messages=MSG, max_tokens=2).choices
            # removed from the table altogether while still streaming: the streams still finish
            cp.table.replace([Endpoint("b", "m", b.url)])
            for t in threads:
                t.join(120)
            assert not any(t.is_alive() for t in threads)
            assert results == [n_tokens] * 6
            # nothing new went to a: the router sent it the streams it held at the drain and nothing
            # else, every one of them finished, and the engines' own counts agree
            assert r.metric("llmgw_router_upstream_attempts_total", endpoint="a") == on_a
            assert r.metric("llmgw_router_upstream_attempts_total", endpoint="a", outcome="ok") == on_a
            assert r.metric("llmgw_router_upstream_attempts_total", endpoint="b") == 6 - on_a + 8
            assert r.metric("llmgw_router_upstream_attempts_total", endpoint="b", outcome="ok") == 6 - on_a + 8
            assert engine_requests(a) == on_a
            assert engine_requests(b) == 6 - on_a + 8
    finally:
        cp.close()
        a.stop()
        b.stop()


def test_router_keeps_serving_while_the_control_plane_is_away(tmp_path):
    [sim] = start_sims(1, env={"LLMGW_SIM_OUTPUT_TOKENS": "2"})
    cp = ControlPlane(tmp_path)
    try:
        cp.table.replace([Endpoint("a", "m", sim.url)])
        with RouterProcess(router_doc(control_plane=cp.router_config()), tmp=tmp_path) as r:
            until(lambda: healthz(r)["endpoints"] == 1, "the router to learn the endpoint", 60, interval=0.05)
            cp.stop_listening()
            until(lambda: "keeping 1 known endpoint" in r.output(), "the watch to notice the outage", 60, interval=0.05)
            c = openai_client(r)
            for _ in range(3):
                assert c.chat.completions.create(model="m", messages=MSG).choices[0].message.content == "tok0 tok1"
            cp.table.replace([])  # changed while the router could not see it
            cp.start()
            until(lambda: healthz(r)["endpoints"] == 0, "the router to resync after the outage", 60, interval=0.05)
            assert [m.id for m in c.models.list()] == []
    finally:
        cp.close()
        sim.stop()


def test_watch_mode_refuses_a_world_readable_key(tmp_path):
    cp = ControlPlane(tmp_path)
    try:
        os.chmod(cp.client_key, 0o644)
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump(router_doc(control_plane=cp.router_config())))
        out = subprocess.run([sys.executable, "-m", "llmgw.router", "--config", str(path)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2
        assert "/control_plane/key" in out.stderr and "chmod 600" in out.stderr
    finally:
        cp.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_router_fed_by_the_watch_serves_its_first_request(tmp_path, workers):
    """A (re)started router listens only once it has the endpoint set, so a client sent to it
    while another router restarts is never told the model does not exist."""
    [sim] = start_sims(1, env={"LLMGW_SIM_OUTPUT_TOKENS": "2"})
    cp = ControlPlane(tmp_path)
    try:
        cp.table.replace([Endpoint("a", "m", sim.url)])
        with RouterProcess(router_doc(control_plane=cp.router_config()), workers=workers, tmp=tmp_path) as r:
            c = openai_client(r)
            for _ in range(2 * workers):  # new connections: each worker must have the set
                assert c.chat.completions.create(model="m", messages=MSG).choices[0].message.content == "tok0 tok1"
                c = openai_client(r)
    finally:
        cp.close()
        sim.stop()
