"""A standalone router fed by the control plane's watch API over mutual TLS: drain, outage."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import yaml

from llmgw.router.endpoints import Endpoint
from test_router_support import ControlPlane, RouterProcess, openai_client, router_doc, start_sims, wait_for

pytestmark = pytest.mark.integration

MSG = [{"role": "user", "content": "hello"}]


def healthz(r):
    return json.loads(r.get("/healthz"))


def test_drained_endpoint_finishes_its_streams_and_gets_nothing_new(tmp_path):
    env = {"LLMGW_SIM_TOKEN_LATENCY": "0.05", "LLMGW_SIM_OUTPUT_TOKENS": "40"}
    a, b = start_sims(2, env=env)
    cp = ControlPlane(tmp_path)
    try:
        cp.table.replace([Endpoint("a", "m", a.url), Endpoint("b", "m", b.url)])
        with RouterProcess(router_doc(control_plane=cp.router_config()), tmp=tmp_path) as r:
            wait_for(lambda: healthz(r)["endpoints"] == 2, 60, "the router to learn both endpoints")
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
            wait_for(lambda: r.metric("llmgw_router_active_streams", endpoint="a") >= 1, 60,
                     "a stream in flight on endpoint a")
            rev = healthz(r)["revision"]
            cp.table.replace([Endpoint("a", "m", a.url, draining=True), Endpoint("b", "m", b.url)])
            wait_for(lambda: healthz(r)["revision"] > rev, 60, "the router to see the drain")
            on_a = r.metric("llmgw_router_upstream_attempts_total", endpoint="a") + \
                r.metric("llmgw_router_active_streams", endpoint="a")
            c = openai_client(r)
            for _ in range(8):
                assert c.chat.completions.create(model="m", messages=MSG, max_tokens=2).choices
            # nothing new went to a: its count (finished + in flight) did not move
            assert r.metric("llmgw_router_upstream_attempts_total", endpoint="a") + \
                r.metric("llmgw_router_active_streams", endpoint="a") == on_a
            assert r.metric("llmgw_router_upstream_attempts_total", endpoint="b") >= 8
            # removed from the table altogether while still streaming: the streams still finish
            cp.table.replace([Endpoint("b", "m", b.url)])
            for t in threads:
                t.join(120)
            assert results == [40] * 6
            assert r.metric("llmgw_router_upstream_attempts_total", endpoint="a", outcome="ok") >= 1
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
            wait_for(lambda: healthz(r)["endpoints"] == 1, 60, "the router to learn the endpoint")
            cp.stop_listening()
            wait_for(lambda: "keeping 1 known endpoint" in r.output(), 60, "the watch to notice the outage")
            c = openai_client(r)
            for _ in range(3):
                assert c.chat.completions.create(model="m", messages=MSG).choices[0].message.content == "tok0 tok1"
            cp.table.replace([])  # changed while the router could not see it
            cp.start()
            wait_for(lambda: healthz(r)["endpoints"] == 0, 60, "the router to resync after the outage")
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
