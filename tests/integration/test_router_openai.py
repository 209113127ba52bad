"""The router as a real process between the official openai client and simulated engines."""

from __future__ import annotations

import json
import signal
import threading
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from llmgw.agent.procident import read_stat
from llmgw.router.auth import hash_key
from router_support import RouterProcess, openai_client, router_doc, start_sims

pytestmark = pytest.mark.integration

MSG = [{"role": "user", "content": "hello"}]
METRICS_TOKEN = "prometheus-scrape-token"


@pytest.fixture(scope="module")
def sims():
    started = start_sims(2, env={"LLMGW_SIM_OUTPUT_TOKENS": "8"})
    yield started
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def router(sims, tmp_path_factory):
    doc = router_doc(
        [{"id": f"sim{i}", "model": "m", "url": s.url} for i, s in enumerate(sims)],
        allow_unauthenticated=False,
        api_keys=[{"name": "ops", "sha256": hash_key("sk-ops")},
                  {"name": "tenant", "sha256": hash_key("sk-tenant"), "models": ["other"]}],
        metrics_tokens=[{"name": "prometheus", "sha256": hash_key(METRICS_TOKEN)}],
    )
    with RouterProcess(doc, tmp=tmp_path_factory.mktemp("router")) as r:
        r.metrics_token = METRICS_TOKEN
        yield r


def post(router, path, raw: bytes, key="sk-ops"):
    req = urllib.request.Request(router.url + path, data=raw, method="POST",
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def test_chat_streaming_and_not(router):
    c = openai_client(router, "sk-ops")
    out = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hello"}], max_tokens=5)
    assert out.choices[0].message.content == "tok0 tok1 tok2 tok3 tok4"
    assert out.usage.completion_tokens == 5
    pieces = []
    for ev in c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
                                        max_tokens=6, stream_options={"include_usage": True}):
        if ev.choices and ev.choices[0].delta.content:
            pieces.append(ev.choices[0].delta.content)
    assert "".join(pieces) == "tok0 tok1 tok2 tok3 tok4 tok5"


def test_completions_embeddings_and_models(router):
    c = openai_client(router, "sk-ops")
    assert c.completions.create(model="m", prompt="once upon", max_tokens=3).choices[0].text == "tok0 tok1 tok2"
    text = "".join(e.choices[0].text for e in c.completions.create(model="m", prompt="x", max_tokens=4, stream=True))
    assert text == "tok0 tok1 tok2 tok3"
    emb = c.embeddings.create(model="m", input=["a", "b"])
    assert len(emb.data) == 2 and len(emb.data[0].embedding) == 16
    assert [m.id for m in c.models.list()] == ["m"]
    assert c.models.retrieve("m").id == "m"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("absent")


def test_api_keys(router):
    with pytest.raises(openai.AuthenticationError) as ei:
        openai_client(router, "sk-wrong").chat.completions.create(model="m", messages=MSG)
    assert ei.value.body["code"] == "invalid_api_key"
    tenant = openai_client(router, "sk-tenant")
    with pytest.raises(openai.NotFoundError) as ei:
        tenant.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert ei.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as absent:
        tenant.chat.completions.create(model="absent", messages=[{"role": "user", "content": "x"}])
    # the same answer as for a model that does not exist: the key learns nothing about "m"
    assert ei.value.body == dict(absent.value.body, message=absent.value.body["message"].replace("absent", "m"))
    assert [m.id for m in tenant.models.list()] == []
    st, _, body = post(router, "/v1/chat/completions", b'{"model":"m","messages":[]}', key="")
    assert st == 401 and json.loads(body)["error"]["type"] == "authentication_error"


def test_bad_requests_are_400_openai_errors(router):
    for raw, code in [(b'{"model": "m", "messages": [', "invalid_json"),
                      (b'{"messages": []}', "missing_model"),
                      (b'"just a string"', "invalid_json")]:
        st, _, body = post(router, "/v1/chat/completions", raw)
        err = json.loads(body)["error"]
        assert st == 400 and err["code"] == code and err["type"] == "invalid_request_error"
    c = openai_client(router, "sk-ops")
    with pytest.raises(openai.NotFoundError) as ei:
        c.chat.completions.create(model="nope", messages=MSG)
    assert ei.value.body["code"] == "model_not_found"


def test_request_id_and_health_and_metrics(router):
    st, headers, _ = post(router, "/v1/embeddings", b'{"model":"m","input":"x"}')
    assert st == 200 and len(headers["X-Request-Id"]) == 24
    assert json.loads(router.get("/healthz"))["endpoints"] == 2
    assert router.metric("llmgw_router_requests_total", model="m", status="200") >= 1
    for key in (None, "sk-ops"):  # it names every model and replica: not for an API key, nor for anyone
        with pytest.raises(urllib.error.HTTPError) as e:
            router.get("/metrics", headers={"Authorization": f"Bearer {key}"} if key else None)
        assert e.value.code == 401
    text = router.get("/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}).decode()
    assert "sk-ops" not in text and hash_key("sk-ops") not in text
    assert "rid=" in router.output() and "key=ops" in router.output()


def test_saturated_endpoint_answers_429(tmp_path):
    [sim] = start_sims(1, env={"LLMGW_SIM_TOKEN_LATENCY": "0.05", "LLMGW_SIM_OUTPUT_TOKENS": "60"})
    try:
        doc = router_doc([{"id": "only", "model": "m", "url": sim.url, "max_concurrency": 2}])
        with RouterProcess(doc, tmp=tmp_path) as r:
            c = openai_client(r)
            streams = [c.chat.completions.create(model="m", messages=MSG, stream=True) for _ in range(2)]
            firsts = [next(iter(s)) for s in streams]  # both are in flight now
            assert all(f.choices for f in firsts)
            with pytest.raises(openai.RateLimitError) as ei:
                c.chat.completions.create(model="m", messages=MSG)
            assert ei.value.response.headers["Retry-After"] == "1"
            assert ei.value.body["code"] == "endpoints_saturated"
            for s in streams:
                assert sum(1 for _ in s) > 0
            assert c.chat.completions.create(model="m", messages=MSG, max_tokens=1).choices
    finally:
        sim.stop()


def _identity(pid: int) -> tuple[int, int] | None:
    """(pid, start time): one process, not whichever reuses its pid later; None once it is gone."""
    st = read_stat(pid)
    return None if st is None else (pid, st.start_time)


def _children_of(pid: int) -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir()
            if p.name.isdigit() and getattr(read_stat(int(p.name)), "ppid", None) == pid]


def test_two_workers_share_the_port_and_metrics_and_drain_on_sigterm(tmp_path):
    [sim] = start_sims(1, env={"LLMGW_SIM_TOKEN_LATENCY": "0.02", "LLMGW_SIM_OUTPUT_TOKENS": "4"})
    try:
        doc = router_doc([{"id": "only", "model": "m", "url": sim.url}], timeouts={"shutdown_grace": 60})
        r = RouterProcess(doc, workers=2, tmp=tmp_path)
        try:
            n = 30
            for _ in range(n):  # a fresh client each time: a new connection, hashed to either worker
                with openai_client(r) as c:
                    assert c.chat.completions.create(model="m", messages=MSG, max_tokens=2).choices
            # any worker's /metrics accounts for all of them (multiprocess collection)
            for _ in range(4):
                assert r.metric("llmgw_router_requests_total", model="m", status="200") == n
            pids = {line.split("llmgw.router.access[")[1].split("]")[0]
                    for line in r.output().splitlines() if "llmgw.router.access[" in line}
            assert len(pids) == 2  # both workers served
            c = openai_client(r)
            # SIGTERM while a stream is in flight: it completes, then the router exits 0
            long = c.chat.completions.create(model="m", messages=MSG, stream=True, max_tokens=100)
            it = iter(long)
            first = next(it)
            got: list[int] = []

            def drain():
                got.append(sum(1 for _ in it))

            th = threading.Thread(target=drain)
            th.start()
            children = {_identity(pid) for pid in _children_of(r.proc.pid)} - {None}
            assert len(children) >= 3  # two workers and the resource tracker
            r.proc.send_signal(signal.SIGTERM)
            th.join(120)
            assert got and got[0] >= 99  # all remaining chunks (the last may carry only finish_reason)
            assert r.proc.wait(60) == 0
            # nothing it started outlives it (workers, multiprocessing's resource tracker): what
            # is left when the main process exits, systemd kills, and may wait out the unit's
            # stop timeout for
            assert {c for c in children if _identity(c[0]) == c} == set()
        finally:
            r.stop()
    finally:
        sim.stop()


def test_https_with_the_operators_own_certificate(sims, tmp_path):
    """TLS from files the operator brings (here: another CA's certificate), verified by the official client."""
    import ssl

    import httpx

    from llmgw.tls import init_ca, issue_server
    from llmgw.tls.files import write_pair

    own_ca = init_ca(tmp_path / "own-ca")
    cert, key = write_pair(tmp_path / "router", *issue_server(own_ca, ["localhost"], ["127.0.0.1"]))
    doc = router_doc([{"id": f"sim{i}", "model": "m", "url": s.url} for i, s in enumerate(sims)],
                     tls={"cert": str(cert), "key": str(key)})
    with RouterProcess(doc, tmp=tmp_path, ca=str(own_ca.cert_path)) as r:
        assert r.url.startswith("https://")
        c = openai_client(r)
        assert c.chat.completions.create(model="m", messages=MSG, max_tokens=3).choices[0].message.content
        assert "".join(e.choices[0].text for e in c.completions.create(model="m", prompt="x", max_tokens=3,
                                                                       stream=True)) == "tok0 tok1 tok2"
        # a client that does not trust the issuing CA refuses the router
        stranger = openai.OpenAI(base_url=r.base_url, api_key="unused", max_retries=0,
                                 http_client=httpx.Client(verify=ssl.create_default_context(), timeout=30))
        with pytest.raises(openai.APIConnectionError):
            stranger.models.list()
