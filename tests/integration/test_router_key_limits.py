"""Per-key limits through real processes: the official openai client, a router on TLS, the engine simulator."""

from __future__ import annotations

import json
import math
import re
import signal
import socket

import httpx
import openai
import pytest
import yaml

from llmgw.router.auth import hash_key
from llmgw.router.limitsgate import BYTES_PER_TOKEN
from llmgw.tls import init_ca, issue_server
from llmgw.tls.files import write_pair
from router_support import HOST, RouterProcess, openai_client, router_doc, start_sims
from tests.support.polling import until

pytestmark = pytest.mark.integration

MSG = [{"role": "user", "content": "hello"}]
METRICS_TOKEN = "scrape-token"
WINDOW = 2  # seconds: the "minute" of the rpm key, short so that its window passes within the test


@pytest.fixture(scope="module")
def sims():
    # a token every 20 ms: a stream lasts long enough to be cut in the middle
    started = start_sims(1, env={"LLMGW_SIM_TOKEN_LATENCY": "0.02", "LLMGW_SIM_OUTPUT_TOKENS": "4"})
    yield started
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def router(sims, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keylimits")
    ca = init_ca(tmp / "ca")
    cert, key = write_pair(tmp / "router", *issue_server(ca, ["localhost"], ["127.0.0.1"]))
    doc = router_doc(
        [{"id": "sim0", "model": "m", "url": sims[0].url}],
        tls={"cert": str(cert), "key": str(key)}, allow_unauthenticated=False,
        api_keys=[
            {"name": "rpm", "sha256": hash_key("sk-rpm"),
             "limits": {"requests_per_minute": 3, "window_seconds": WINDOW}},
            {"name": "tok", "sha256": hash_key("sk-tok"),
             "limits": {"tokens_per_minute": 5000, "default_max_tokens": 16}},
            {"name": "free", "sha256": hash_key("sk-free")},
        ],
        metrics_tokens=[{"name": "prometheus", "sha256": hash_key(METRICS_TOKEN)}],
    )
    with RouterProcess(doc, workers=1, tmp=tmp, ca=str(ca.cert_path)) as r:
        r.metrics_token = METRICS_TOKEN
        yield r


def test_a_key_just_under_its_limit_is_never_refused_and_just_over_gets_429_then_the_clients_retry_succeeds(router):
    c = openai_client(router, "sk-rpm")  # no other test uses this key
    seen = []
    for _ in range(3):
        raw = c.chat.completions.with_raw_response.create(model="m", messages=MSG, max_tokens=2)
        assert raw.http_response.status_code == 200
        seen.append(raw.headers["x-ratelimit-remaining-requests"])
        assert raw.headers["x-ratelimit-limit-requests"] == "3"
    assert seen == ["2", "1", "0"]
    with pytest.raises(openai.RateLimitError) as e:
        c.chat.completions.create(model="m", messages=MSG, max_tokens=2)
    h = e.value.response.headers
    retry_after, retry_ms = int(h["retry-after"]), int(h["retry-after-ms"])
    # the oldest request ages out within the window and one slot of it (1/60), never later
    assert 0 < retry_ms <= WINDOW * 1000 * 61 / 60 + 1 and retry_after == math.ceil(retry_ms / 1000)
    assert e.value.body["code"] == "rate_limit_exceeded" and h["x-ratelimit-remaining-requests"] == "0"
    assert router.metric("llmgw_router_key_refusals_total", key="rpm", limit="requests") >= 1
    # the official client's own retry logic (it sleeps retry-after-ms) gets through once the window passed
    patient = openai.OpenAI(base_url=router.base_url, api_key="sk-rpm", max_retries=2,
                            http_client=httpx.Client(verify=router.ssl, timeout=60))
    out = patient.chat.completions.create(model="m", messages=MSG, max_tokens=2)
    assert out.choices[0].message.content == "tok0 tok1"


def test_usage_is_settled_from_the_engine_and_the_usage_event_reaches_only_a_client_that_asked(router):
    before_c = router.metric("llmgw_router_key_completion_tokens_total", key="tok", model="m")
    before_r = router.metric("llmgw_router_key_requests_total", key="tok", model="m")
    c = openai_client(router, "sk-tok")
    raw = c.chat.completions.with_raw_response.create(model="m", messages=MSG, max_tokens=3)
    assert raw.parse().usage.completion_tokens == 3
    assert int(raw.headers["x-ratelimit-limit-tokens"]) == 5000
    # a stream that did not ask for usage: the router asks the engine, reads it, and cuts it out
    events = [e for e in c.chat.completions.create(model="m", messages=MSG, max_tokens=3, stream=True)]
    assert events and all(e.usage is None for e in events) and all(e.choices for e in events)
    asked = [e for e in c.chat.completions.create(model="m", messages=MSG, max_tokens=3, stream=True,
                                                   stream_options={"include_usage": True})]
    assert asked[-1].usage is not None and asked[-1].usage.completion_tokens == 3
    until(lambda: router.metric("llmgw_router_key_requests_total", key="tok", model="m") == before_r + 3,
          "three settled requests")
    assert router.metric("llmgw_router_key_completion_tokens_total", key="tok", model="m") == before_c + 9
    # every answer to a limited key carries the headers, one refused before admission too
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="absent", messages=MSG, max_tokens=1)
    assert e.value.response.headers["x-ratelimit-limit-tokens"] == "5000"
    # a key without limits gets no rate-limit headers and no usage it did not ask for
    free = openai_client(router, "sk-free").chat.completions.with_raw_response.create(model="m", messages=MSG,
                                                                                       max_tokens=2)
    assert "x-ratelimit-limit-requests" not in free.headers and "x-ratelimit-limit-tokens" not in free.headers


def test_a_cancelled_stream_settles_what_it_used(router):
    before_p = router.metric("llmgw_router_key_prompt_tokens_total", key="tok", model="m")
    before_c = router.metric("llmgw_router_key_completion_tokens_total", key="tok", model="m")
    before_r = router.metric("llmgw_router_key_requests_total", key="tok", model="m")
    body = {"model": "m", "messages": MSG, "max_tokens": 400, "stream": True}
    raw = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer sk-tok\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n").encode()
    with socket.create_connection((HOST, router.port), timeout=30) as plain, \
            router.ssl.wrap_socket(plain, server_hostname="localhost") as s:
        s.sendall(head + raw)
        seen = b""
        while len(re.findall(rb'"content":" ?tok[0-9]', seen)) < 5:
            chunk = s.recv(65536)
            assert chunk, seen
            seen += chunk
        assert seen.startswith(b"HTTP/1.1 200") and b"x-ratelimit-limit-tokens: 5000" in seen.lower()
    # hung up mid-stream
    until(lambda: router.metric("llmgw_router_key_requests_total", key="tok", model="m") == before_r + 1,
          "the cancelled stream to be settled", 30)
    used = router.metric("llmgw_router_key_completion_tokens_total", key="tok", model="m") - before_c
    assert 5 <= used < 400  # what was relayed, not the reservation of 400
    sent = len(raw)
    assert router.metric("llmgw_router_key_prompt_tokens_total", key="tok", model="m") - before_p == pytest.approx(
        sent / BYTES_PER_TOKEN, abs=2)


def test_sighup_puts_changed_limits_in_force_and_a_bad_file_changes_nothing(sims, tmp_path):
    def doc(rpm, extra=None):
        key = {"name": "hup", "sha256": hash_key("sk-hup"), "limits": {"requests_per_minute": rpm}}
        return router_doc([{"id": "sim0", "model": "m", "url": sims[0].url}], allow_unauthenticated=False,
                          api_keys=[key] + (extra or []))

    with RouterProcess(doc(5), tmp=tmp_path) as r:
        def limit(key="sk-hup"):
            try:
                raw = openai_client(r, key).chat.completions.with_raw_response.create(
                    model="m", messages=MSG, max_tokens=1)
            except openai.AuthenticationError:
                return "unauthorized"
            return raw.headers.get("x-ratelimit-limit-requests")

        assert limit() == "5" and limit("sk-new") == "unauthorized"
        cfg = {"listen": {"host": HOST, "port": r.port}}
        r.config_path.write_text(yaml.safe_dump({**cfg, **doc(7, [{"name": "new", "sha256": hash_key("sk-new")}])}))
        r.proc.send_signal(signal.SIGHUP)
        until(lambda: limit() == "7", "the reloaded limit")
        assert limit("sk-new") is None  # a key added by the reload, without limits
        r.config_path.write_text(yaml.safe_dump({**cfg, **doc(0)}))  # invalid: below the minimum
        r.proc.send_signal(signal.SIGHUP)
        until(lambda: "refused, the keys in force stay" in r.output(), "the refusal in the log")
        assert "/api_keys/0/limits/requests_per_minute" in r.output()
        assert limit() == "7" and r.proc.poll() is None


def test_cached_prompt_tokens_count_the_keys_weight_in_its_token_window(tmp_path):
    """Two keys, the same requests: a long prompt, then the same prompt again (which the engine finds
    in its prefix cache and says so, as vLLM does with --enable-prompt-tokens-details), then a
    third whose headers show what the first two left of the window. The key whose cached tokens
    weigh 0 was charged exactly the second answer's cached tokens less."""
    from simproc import start_sim

    sim = start_sim(model="m", extra_args=["--enable-prompt-tokens-details"], timeout=120)
    try:
        keys = [{"name": name, "sha256": hash_key(f"sk-{name}"),
                 "limits": {"tokens_per_minute": 100_000, "default_max_tokens": 1, "cached_prompt_weight": weight}}
                for name, weight in (("whole", 1), ("free", 0))]
        doc = router_doc([{"id": "sim0", "model": "m", "url": sim.url}], allow_unauthenticated=False, api_keys=keys,
                         metrics_tokens=[{"name": "prometheus", "sha256": hash_key(METRICS_TOKEN)}])
        with RouterProcess(doc, workers=1, tmp=tmp_path) as r:
            r.metrics_token = METRICS_TOKEN
            left, cached, prompt = {}, {}, {}
            for name, tag in (("whole", "alpha1"), ("free", "alpha2")):
                c = openai_client(r, f"sk-{name}")
                # the same bytes and tokens for both keys but a first word of their own: each key's first
                # request is uncached, and the third's reservation (from the body's size) is the same
                msg = [{"role": "user", "content": " ".join([tag] + [f"w{i}" for i in range(200)])}]
                first = c.chat.completions.create(model="m", messages=msg, max_tokens=1)
                second = c.chat.completions.create(model="m", messages=msg, max_tokens=1)
                assert first.usage.prompt_tokens == second.usage.prompt_tokens
                prompt[name] = first.usage.prompt_tokens
                assert (first.usage.prompt_tokens_details.cached_tokens or 0) == 0
                cached[name] = second.usage.prompt_tokens_details.cached_tokens
                assert 0 < cached[name] < second.usage.prompt_tokens
                until(lambda: r.metric("llmgw_router_key_requests_total", key=name, model="m") == 2,
                      "both requests settled")
                third = c.chat.completions.with_raw_response.create(model="m", messages=msg, max_tokens=1)
                left[name] = int(third.headers["x-ratelimit-remaining-tokens"])
            assert prompt["free"] == prompt["whole"] and cached["free"] == cached["whole"]
            assert left["free"] - left["whole"] == cached["free"]
            # the usage counters count cached tokens apart, unweighted, for either key
            assert r.metric("llmgw_router_key_cached_prompt_tokens_total", key="free", model="m") >= cached["free"]
    finally:
        sim.stop()
