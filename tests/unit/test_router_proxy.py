"""The proxy against scripted engines: real sockets, one process.

Each engine here is a small aiohttp server whose behaviour the test scripts
byte for byte (where exactly a stream breaks, what an error chunk looks
like), which the simulator cannot do at this granularity.  The simulator
versions of these scenarios are in tests/integration/test_router_faults.py.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import re

import pytest
from aiohttp import web
from proxy_harness import DONE, METRICS_TOKEN, ROLE, SCRAPE, Engine, Router, chunk, eps, error_event, events, stream

from llmgw.router.app import ADMISSION_KEY, PROXY_KEY
from llmgw.router.auth import hash_key
from llmgw.router.endpoints import Endpoint
from tests.support.polling import run_async as run, until_async
from tests.support.ports import closed_port


ERR = b'data: {"error":{"message":"EngineCore died","type":"InternalServerError","param":null,"code":500}}\n\n'


def healthy(n=3, delay=0.0):
    async def b(request, body):
        if json.loads(body).get("stream"):
            return await stream(request, [ROLE] + [chunk(i) for i in range(n)] + [DONE], delay)
        return web.json_response({"choices": [{"message": {"content": "ok"}}]})
    return b


def status(code, text='{"error":{"message":"nope","type":"x","param":null,"code":0}}'):
    async def b(request, body):
        return web.Response(status=code, text=text, content_type="application/json")
    return b


# ---------------------------------------------------------------- streaming

@run
async def test_stream_is_relayed_byte_for_byte():
    a = await Engine(healthy(5)).start()
    async with Router(eps(a)) as r:
        st, hdrs, body = await r.chat_stream()
    assert st == 200 and hdrs["Content-Type"].startswith("text/event-stream")
    assert body == ROLE + b"".join(chunk(i) for i in range(5)) + DONE
    await a.stop()


@run
async def test_crash_before_first_token_is_retried_invisibly():
    """The role-only chunk went out, then the engine died: the client must see one clean stream."""
    async def dies(request, body):
        return await stream(request, [ROLE], abort=True)
    a, b = await Engine(dies).start(), await Engine(healthy(3)).start()
    async with Router(eps(a, b), {"retries": {"budget_min": 100}}) as r:
        for _ in range(60):  # until the dying engine got its share of picks
            st, _, body = await r.chat_stream()
            assert st == 200
            assert body == ROLE + chunk(0) + chunk(1) + chunk(2) + DONE
            if len(a.requests) >= 2:
                break
        assert await r.metric("llmgw_router_upstream_attempts_total", endpoint="e0", outcome="broken") >= 1
        assert await r.metric("llmgw_router_retries_total", reason="broken") >= 1
    await a.stop(); await b.stop()


@run
async def test_break_after_first_token_ends_with_error_event_and_no_partial_event():
    async def breaks(request, body):
        half = chunk(2)[:20]
        return await stream(request, [ROLE, chunk(0), chunk(1) + half], abort=True)
    a, b = await Engine(breaks).start(), await Engine(healthy()).start()
    async with Router(eps(a) + [Endpoint(id="e1", model="m", url=b.url, draining=True)]) as r:
        st, _, body = await r.chat_stream()
        assert st == 200
        evs = events(body)
        assert evs[:3] == [ROLE, chunk(0), chunk(1)]  # never the half-written third one
        err = error_event(body)
        assert err and err["code"] == "upstream_stream_broken" and err["type"] == "server_error"
        assert evs[-1] == DONE and len(evs) == 5
        assert len(b.requests) == 0  # not retried after the commit point
        assert await r.metric("llmgw_router_upstream_attempts_total", endpoint="e0", outcome="broken") == 1
    await a.stop(); await b.stop()


@run
async def test_stream_ending_without_done_is_an_error_not_a_short_answer():
    async def short(request, body):
        return await stream(request, [ROLE, chunk(0)])
    a = await Engine(short).start()
    async with Router(eps(a)) as r:
        _, _, body = await r.chat_stream()
    assert events(body)[:2] == [ROLE, chunk(0)]
    assert error_event(body)["code"] == "upstream_stream_broken"
    assert body.endswith(DONE)
    await a.stop()


@run
async def test_inband_error_after_tokens_is_relayed_and_counts_as_failure():
    async def err(request, body):
        return await stream(request, [ROLE, chunk(0), ERR, DONE], delay=0.05)
    a = await Engine(err).start()
    async with Router(eps(a), {"outlier": {"consecutive_errors": 2}}) as r:
        _, _, body = await r.chat_stream()
        assert body == ROLE + chunk(0) + ERR + DONE
        assert r.routing.runtimes()[0].health.consecutive_failures == 1
        _, _, body = await r.chat_stream()
        assert r.routing.runtimes()[0].health.is_ejected(__import__("time").monotonic())
        assert await r.metric("llmgw_router_ejections_total", endpoint="e0") == 1
        st, hdrs, body = await r.chat_stream()  # the only endpoint is out: fast, explicit 503
        assert st == 503 and json.loads(body)["error"]["code"] == "no_healthy_endpoint"
        assert "Retry-After" in hdrs
    await a.stop()


@run
async def test_inband_error_as_first_event_is_retried():
    async def err(request, body):
        return await stream(request, [ROLE, ERR, DONE])
    a, b = await Engine(err).start(), await Engine(healthy(2)).start()
    async with Router(eps(a, b), {"retries": {"budget_min": 100}}) as r:
        for _ in range(60):
            st, _, body = await r.chat_stream()
            assert st == 200 and body == ROLE + chunk(0) + chunk(1) + DONE
            if len(a.requests) >= 2:
                break
        assert await r.metric("llmgw_router_upstream_attempts_total", outcome="inband_error") >= 1
    await a.stop(); await b.stop()


@run
async def test_stalled_stream_is_cut_by_the_inter_token_watchdog():
    never = asyncio.Event()

    async def stalls(request, body):
        return await stream(request, [chunk(0), chunk(1)], hold=never)
    a = await Engine(stalls).start()
    async with Router(eps(a), {"timeouts": {"inter_token": 0.3}}) as r:
        st, _, body = await r.chat_stream()
        assert st == 200
        assert events(body)[0] == chunk(0)
        assert error_event(body)["code"] == "upstream_stream_stalled"
        assert await r.metric("llmgw_router_upstream_attempts_total", outcome="inter_token_timeout") == 1
    never.set()
    await a.stop()


@run
async def test_no_first_token_is_a_watchdog_failure_and_retried():
    never = asyncio.Event()

    async def silent(request, body):
        return await stream(request, [ROLE], hold=never)
    a, b = await Engine(silent).start(), await Engine(healthy(1)).start()
    async with Router(eps(a, b), {"timeouts": {"first_token": 0.3}}) as r:
        for _ in range(60):
            st, _, body = await r.chat_stream()
            assert st == 200 and body == ROLE + chunk(0) + DONE
            if a.requests:
                break
        assert await r.metric("llmgw_router_upstream_attempts_total", endpoint="e0",
                              outcome="first_token_timeout") >= 1
    never.set()
    await a.stop(); await b.stop()


# ------------------------------------------------------------- status codes

@run
async def test_client_errors_pass_through_without_retry():
    a = await Engine(status(400)).start()
    b = await Engine(status(400)).start()
    async with Router(eps(a, b)) as r:
        st, _, body = await r.post(body={"model": "m", "messages": []})
        assert st == 400 and json.loads(body)["error"]["message"] == "nope"
        assert len(a.requests) + len(b.requests) == 1
    await a.stop(); await b.stop()


@run
async def test_5xx_is_retried_elsewhere_and_reported_when_no_retry_is_left():
    bad, good = await Engine(status(500)).start(), await Engine(healthy()).start()
    async with Router(eps(bad, good), {"retries": {"budget_min": 100}}) as r:
        for _ in range(60):
            st, _, _ = await r.post()
            assert st == 200
            if len(bad.requests) >= 2:
                break
        assert len(bad.requests) >= 2
    async with Router(eps(bad), {"retries": {"max_attempts": 1}}) as r:
        st, _, body = await r.post()
        err = json.loads(body)["error"]
        assert st == 502 and err["code"] == "upstream_error" and "HTTP 500" in err["message"]
        assert set(err) == {"message", "type", "param", "code"}
    await bad.stop(); await good.stop()


@run
async def test_an_engines_5xx_body_stays_in_the_log_and_the_client_gets_the_request_id(caplog):
    trace = "Traceback (most recent call last):\n  File \"/opt/vllm/engine.py\", line 42"
    bad = await Engine(status(500, text=trace)).start()
    async with Router(eps(bad), {"retries": {"max_attempts": 1}}) as r:
        with caplog.at_level(logging.WARNING, logger="llmgw.router"):
            st, headers, body = await r.post(headers={"X-Request-Id": "rid-42"})
        err = json.loads(body)["error"]
        assert st == 502 and err["code"] == "upstream_error" and "HTTP 500" in err["message"]
        assert "rid-42" in err["message"] and headers["X-Request-Id"] == "rid-42"
        assert "Traceback" not in body.decode() and "/opt/vllm" not in body.decode()
        assert any("rid-42" in line and "/opt/vllm/engine.py" in line for line in caplog.text.splitlines())
    await bad.stop()


@run
async def test_metrics_need_a_metrics_token_unless_the_router_is_open():
    a = await Engine(healthy()).start()
    keyed = {"allow_unauthenticated": False, "api_keys": [{"name": "k", "sha256": hash_key("sk-1")}]}
    async with Router(eps(a), keyed) as r:
        for headers in ({}, {"Authorization": "Bearer sk-1"}, {"Authorization": "Bearer wrong"},
                        {"Authorization": METRICS_TOKEN}):
            async with r.http.get(r.url + "/metrics", headers=headers) as resp:
                assert resp.status == 401, headers
                assert "llmgw_router" not in await resp.text()
        async with r.http.get(r.url + "/metrics", headers=SCRAPE) as resp:
            assert resp.status == 200 and "llmgw_router_requests_total" in await resp.text()
    async with Router(eps(a), {**keyed, "metrics_tokens": []}) as r:  # none configured: closed
        async with r.http.get(r.url + "/metrics", headers=SCRAPE) as resp:
            assert resp.status == 401
    async with Router(eps(a), {"metrics_tokens": []}) as r:  # an open router without tokens: open
        async with r.http.get(r.url + "/metrics") as resp:
            assert resp.status == 200
    await a.stop()


@run
async def test_an_admitted_request_hashes_its_key_once():
    """Admission authenticates before it reads the body; the proxy reuses that principal.

    Hashing the key twice cost every request a second SHA-256 and lookup.
    """
    a = await Engine(healthy()).start()
    keyed = {"allow_unauthenticated": False, "api_keys": [{"name": "k", "sha256": hash_key("sk-1")}]}
    async with Router(eps(a), keyed) as r:
        keys = r.app[PROXY_KEY].keys
        calls = []
        real = keys.authenticate

        def counted(authorization):
            calls.append(authorization)
            return real(authorization)
        keys.authenticate = counted
        status_, _, _ = await r.post(body={"model": "m", "messages": []}, headers={"Authorization": "Bearer sk-1"})
        assert status_ == 200 and len(calls) == 1
        status_, _, _ = await r.post(body={"model": "m", "messages": []}, headers={"Authorization": "Bearer bad"})
        assert status_ == 401  # refused by the proxy, as before
    await a.stop()


@run
async def test_requests_over_a_keys_cap_get_429_with_retry_after_and_others_are_served():
    release = asyncio.Event()

    async def held(request, body):
        await release.wait()
        return web.json_response({"choices": []})
    a = await Engine(held).start()
    doc = {"allow_unauthenticated": False,
           "api_keys": [{"name": "k1", "sha256": hash_key("sk-1")}, {"name": "k2", "sha256": hash_key("sk-2")}],
           "clients": {"max_requests_per_key": 2, "max_requests_per_source": 0}}
    async with Router(eps(a), doc) as r:
        k1 = {"Authorization": "Bearer sk-1"}
        first = [asyncio.create_task(r.post(headers=k1)) for _ in range(2)]
        while len(a.requests) < 2:
            await asyncio.sleep(0.01)
        st, headers, body = await r.post(headers=k1)
        err = json.loads(body)["error"]
        assert st == 429 and headers["Retry-After"] == "1" and err["type"] == "rate_limit_error"
        assert set(err) == {"message", "type", "param", "code"}
        other = asyncio.create_task(r.post(headers={"Authorization": "Bearer sk-2"}))
        while len(a.requests) < 3:
            await asyncio.sleep(0.01)
        release.set()
        assert [x[0] for x in await asyncio.gather(*first, other)] == [200, 200, 200]
        assert (await r.post(headers=k1))[0] == 200  # released when they ended
    await a.stop()


@run
async def test_body_bytes_over_the_sources_cap_are_refused_before_they_are_read():
    a = await Engine(healthy()).start()
    doc = {"limits": {"max_body_bytes": 1 << 20},
           "clients": {"max_body_bytes_per_source": 1 << 20, "body_grace": 0.3, "body_min_rate": 1 << 30}}
    async with Router(eps(a), doc) as r:
        host, port = r.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        size = 1 << 20
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n{" % size)  # held one byte in: the reservation stands
        await writer.drain()
        for _ in range(200):
            st, headers, body = await r.post()  # 11 bytes: over the 1 MiB already reserved
            if st == 429:
                break
            await asyncio.sleep(0.01)
        assert st == 429 and headers["Retry-After"] == "1"
        head = await asyncio.wait_for(reader.read(), 30)  # the held body is cut (408) and closed
        assert head.startswith(b"HTTP/1.1 408")
        writer.close()
        assert (await r.post())[0] == 200  # its reservation went with it
    await a.stop()


def _chunked_head() -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _connect(r, data: bytes):
    host, port = r.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    await writer.drain()
    return reader, writer


async def _status(reader) -> int:
    return int((await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)).split(b" ", 2)[1])


def _held(r) -> int:
    """Body bytes the router holds for 127.0.0.1 now (0 once nothing is in flight)."""
    held = r.app[ADMISSION_KEY].holdings.by_source.get("127.0.0.1")
    return held.bytes if held is not None else 0


def _nothing_held(r) -> bool:
    h = r.app[ADMISSION_KEY].holdings
    return h.by_source == {} and h.by_key == {}


@run
async def test_a_chunked_body_holds_what_it_sent_and_gives_it_back_however_it_ends():
    a = await Engine(healthy()).start()
    doc = {"limits": {"max_body_bytes": 4096},
           "clients": {"max_body_bytes_per_source": 4096, "max_requests_per_source": 0, "body_grace": 30}}
    body = json.dumps({"model": "m", "messages": []}).encode()
    async with Router(eps(a), doc) as r:
        # served: the engine gets the body as sent, and the bytes it held are given back
        reader, writer = await _connect(r, _chunked_head() + _chunk(body[:5]))
        await until_async(lambda: _held(r) == 5, "the first chunk held", 20)
        writer.write(_chunk(body[5:]) + b"0\r\n\r\n")
        assert await _status(reader) == 200 and a.requests[-1][1] == body
        writer.close()
        await until_async(lambda: _nothing_held(r), "the served body given back", 20)
        # a body that crosses the source's cap mid-body, beside one holding most of it: 429, both given back
        r1, w1 = await _connect(r, _chunked_head() + _chunk(b"{" + b" " * 3999))
        await until_async(lambda: _held(r) == 4000, "4000 bytes held", 20)
        r2, w2 = await _connect(r, _chunked_head() + _chunk(b"{"))
        await until_async(lambda: _held(r) == 4001, "the second body's first byte held", 20)
        w2.write(_chunk(b" " * 96))
        assert await _status(r2) == 429
        await until_async(lambda: _held(r) == 4000, "the refused body's bytes given back", 20)
        # the client that hangs up mid-body gives its bytes back
        w1.transport.abort()
        await until_async(lambda: _nothing_held(r), "the abandoned body given back", 20)
        # past limits.max_body_bytes on its own: 413, given back
        r3, w3 = await _connect(r, _chunked_head() + _chunk(b"{" + b" " * 4096))
        assert await _status(r3) == 413
        await until_async(lambda: _nothing_held(r), "the body over the limit given back", 20)
        for w in (w2, w3):
            w.close()
        assert await r.metric("llmgw_router_errors_total", model="-", **{"class": "max_body_bytes_per_source"}) == 1
        assert await r.metric("llmgw_router_errors_total", model="-", **{"class": "too_large"}) == 1
    await a.stop()


@run
async def test_a_chunked_body_too_slow_is_cut_and_gives_its_bytes_back():
    a = await Engine(healthy()).start()
    doc = {"limits": {"max_body_bytes": 4096}, "clients": {"body_grace": 0.2, "body_min_rate": 1 << 30}}
    async with Router(eps(a), doc) as r:
        reader, writer = await _connect(r, _chunked_head() + _chunk(b"{"))
        assert await _status(reader) == 408
        await until_async(lambda: _nothing_held(r), "the cut body given back", 20)
        writer.close()
        assert await r.metric("llmgw_router_errors_total", model="-", **{"class": "body_timeout"}) == 1
        assert await r.metric("llmgw_router_requests_total", model="-", status="408") == 1
    await a.stop()


@run
async def test_retry_budget_caps_amplification():
    a, b, c = [await Engine(status(503)).start() for _ in range(3)]
    async with Router(eps(a, b, c), {"retries": {"budget_min": 0, "budget_ratio": 0.2}}) as r:
        for _ in range(50):
            st, _, _ = await r.post()
            assert st == 502
        attempts = len(a.requests) + len(b.requests) + len(c.requests)
        assert attempts <= 60
        assert await r.metric("llmgw_router_retries_denied_total") >= 30
    for e in (a, b, c):
        await e.stop()


@run
async def test_a_refused_connection_is_retried_without_spending_the_retry_budget():
    """A refused connect put no request on any engine: its retry adds no load, so it is not rationed.

    At a low request rate the budget is its minimum (3 per window): an engine
    killed between two requests used to spend it on refused connects before
    it was ejected, and clients got 502 while a healthy replica stood by.
    """
    good = await Engine(healthy()).start()
    endpoints = [Endpoint("dead", "m", f"http://127.0.0.1:{closed_port()}"), Endpoint("good", "m", good.url)]
    async with Router(endpoints, {"retries": {"budget_min": 0, "budget_ratio": 0}}) as r:
        for _ in range(20):
            st, _, body = await r.post()
            assert st == 200, body
        assert await r.metric("llmgw_router_retries_total", reason="connect") >= 1
        assert await r.metric("llmgw_router_retries_denied_total") == 0
    await good.stop()


@run
async def test_connect_refused_is_retried_and_ejects():
    good = await Engine(healthy()).start()
    dead_url = f"http://127.0.0.1:{closed_port()}"
    endpoints = [Endpoint("dead", "m", dead_url), Endpoint("good", "m", good.url)]
    async with Router(endpoints, {"outlier": {"consecutive_errors": 2}, "retries": {"budget_min": 100}}) as r:
        for _ in range(20):
            st, _, _ = await r.post()
            assert st == 200
        assert await r.metric("llmgw_router_ejections_total", endpoint="dead") >= 1
        assert await r.metric("llmgw_router_upstream_attempts_total", endpoint="dead", outcome="connect") >= 2
    await good.stop()


# ------------------------------------------------------- limits and table

@run
async def test_saturated_model_answers_429_with_retry_after():
    release = asyncio.Event()

    async def slow(request, body):
        return await stream(request, [chunk(0), DONE], hold=release)
    a = await Engine(slow).start()
    async with Router(eps(a, max_concurrency=1)) as r:
        first = asyncio.create_task(r.chat_stream())
        while r.routing.runtimes()[0].outstanding == 0:
            await asyncio.sleep(0.01)
        st, hdrs, body = await r.chat_stream()
        assert st == 429 and hdrs["Retry-After"] == "1"
        assert json.loads(body)["error"]["code"] == "endpoints_saturated"
        release.set()
        assert (await first)[0] == 200
        assert (await r.chat_stream())[0] == 200
    await a.stop()


@run
async def test_draining_and_removed_endpoints_finish_what_they_have():
    release = asyncio.Event()

    async def slow(request, body):
        return await stream(request, [chunk(0), chunk(1), DONE], hold=release)
    a, b = await Engine(slow).start(), await Engine(healthy()).start()
    async with Router([Endpoint("a", "m", a.url)]) as r:
        inflight = asyncio.create_task(r.chat_stream())
        while not a.requests:
            await asyncio.sleep(0.01)
        r.table.replace([Endpoint("a", "m", a.url, draining=True), Endpoint("b", "m", b.url)])
        for _ in range(5):
            assert (await r.chat_stream())[0] == 200
        assert len(a.requests) == 1 and len(b.requests) == 5
        r.table.replace([Endpoint("b", "m", b.url)])  # gone from the table entirely
        assert (await r.chat_stream())[0] == 200
        release.set()
        st, _, body = await inflight
        assert st == 200 and body == chunk(0) + chunk(1) + DONE
        r.routing.housekeeping()
        assert [rt.id for rt in r.routing.runtimes()] == ["b"]
    await a.stop(); await b.stop()


@run
async def test_a_retry_never_goes_to_an_endpoint_that_started_draining_meanwhile():
    r: Router

    async def drain_a_then_fail(request, body):
        # the drain lands while this attempt is in flight and no other request syncs the router
        r.table.replace([Endpoint("bad", "m", bad.url), Endpoint("a", "m", a.url, draining=True)])
        return await status(500)(request, body)
    bad, a = await Engine(drain_a_then_fail).start(), await Engine(healthy()).start()
    async with Router([Endpoint("bad", "m", bad.url), Endpoint("a", "m", a.url)],
                      {"retries": {"budget_min": 100}}) as r:
        for _ in range(60):  # until the first attempt lands on "bad" (each try: one chance in two)
            r.table.replace([Endpoint("bad", "m", bad.url), Endpoint("a", "m", a.url)])
            before = len(a.requests)
            st, _, body = await r.post()
            if bad.requests:
                break
            assert st == 200 and len(a.requests) == before + 1
        assert len(bad.requests) == 1
        # the retry found nothing it may use: "a" drains, "bad" was tried
        assert len(a.requests) == before
        assert st == 502 and json.loads(body)["error"]["code"] == "upstream_error"
    await bad.stop(); await a.stop()


@run
async def test_client_disconnect_releases_the_endpoint():
    never = asyncio.Event()

    async def slow(request, body):
        return await stream(request, [chunk(0), chunk(1)], hold=never)
    a = await Engine(slow).start()
    async with Router(eps(a)) as r:
        async with r.http.post(r.url + "/v1/chat/completions",
                               json={"model": "m", "stream": True}) as resp:
            assert (await resp.content.readany()).startswith(b"data:")
        rt = r.routing.runtimes()[0]
        for _ in range(500):
            if rt.outstanding == 0:
                break
            await asyncio.sleep(0.01)
        assert rt.outstanding == 0
        assert not rt.health.consecutive_failures  # the client left; the engine did nothing wrong
    never.set()
    await a.stop()


@run
async def test_request_id_passes_through_or_is_generated():
    a = await Engine(healthy()).start()
    async with Router(eps(a)) as r:
        _, hdrs, _ = await r.post(headers={"X-Request-Id": "req-123"})
        assert hdrs["X-Request-Id"] == "req-123" and a.requests[-1][0]["X-Request-Id"] == "req-123"
        _, hdrs, _ = await r.post()
        assert len(hdrs["X-Request-Id"]) == 24 and a.requests[-1][0]["X-Request-Id"] == hdrs["X-Request-Id"]
        _, hdrs, _ = await r.post(headers={"X-Request-Id": "bad id\twith spaces"})
        assert hdrs["X-Request-Id"] != "bad id\twith spaces"
    await a.stop()


@run
async def test_original_body_bytes_are_forwarded_and_client_key_is_not():
    a = await Engine(healthy()).start()
    raw = b'{"model":"m",   "messages":[], "extra_field": {"keep": [1, 2.50]}}'
    async with Router(eps(a), {"api_keys": [{"name": "k", "sha256": hash_key("sk-1")}],
                               "allow_unauthenticated": False}) as r:
        st, _, _ = await r.post(raw=raw, headers={"Authorization": "Bearer sk-1",
                                                  "Content-Type": "application/json"})
        assert st == 200
        headers, body = a.requests[-1]
        assert body == raw
        assert "Authorization" not in headers
    await a.stop()


def keyed(key):
    """An engine that enforces ``key`` the way vLLM does."""
    ok = healthy()

    async def b(request, body):
        if request.headers.get("Authorization") != f"Bearer {key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await ok(request, body)
    return b


@run
async def test_each_endpoints_engine_key_is_sent_in_place_of_the_clients_key():
    a, b = await Engine(keyed("key-a")).start(), await Engine(keyed("key-b")).start()
    endpoints = [Endpoint(id="a", model="m", url=a.url, api_key="key-a"),
                 Endpoint(id="b", model="m2", url=b.url, api_key="key-b")]
    async with Router(endpoints, {"api_keys": [{"name": "k", "sha256": hash_key("sk-1")}],
                                  "allow_unauthenticated": False}) as r:
        for model in ("m", "m2"):
            for stream in (False, True):
                st, _, _ = await r.post(body={"model": model, "messages": [], "stream": stream},
                                        headers={"Authorization": "Bearer sk-1"})
                assert st == 200
    assert a.requests and b.requests
    assert {h["Authorization"] for h, _ in a.requests} == {"Bearer key-a"}
    assert {h["Authorization"] for h, _ in b.requests} == {"Bearer key-b"}
    await a.stop(); await b.stop()


@pytest.mark.parametrize("stream", [False, True])
@run
async def test_an_engine_refusing_the_key_is_that_endpoints_fault_not_the_clients(stream):
    stale, good = await Engine(keyed("new")).start(), await Engine(keyed("k2")).start()
    body = {"model": "m", "messages": [], "stream": stream}
    async with Router([Endpoint(id="stale", model="m", url=stale.url, api_key="old"),
                       Endpoint(id="good", model="m", url=good.url, api_key="k2")],
                      {"retries": {"budget_min": 100}}) as r:
        for _ in range(20):
            st, _, _ = await r.post(body=body)
            assert st == 200, "retried on the other replica, never a 401 to the client"
        assert stale.requests, "the stale endpoint was tried"
        assert await r.metric("llmgw_router_upstream_attempts_total", endpoint="stale", outcome="engine_auth") >= 1
    async with Router([Endpoint(id="stale", model="m", url=stale.url, api_key="old")],
                      {"retries": {"max_attempts": 1}}) as r:
        st, _, raw = await r.post(body=body)
        err = json.loads(raw)["error"]
        assert st == 502 and err["code"] == "upstream_error" and "engine key" in err["message"]
    await stale.stop(); await good.stop()


# ------------------------------------------------------- errors of the API

@run
async def test_api_errors_are_openai_shaped():
    a = await Engine(healthy()).start()
    doc = {"allow_unauthenticated": False, "limits": {"max_body_bytes": 2048},
           "api_keys": [{"name": "alice", "sha256": hash_key("sk-a"), "models": ["other"]},
                        {"name": "ops", "sha256": hash_key("sk-o")}]}
    async with Router(eps(a), doc) as r:
        ok = {"Authorization": "Bearer sk-o"}
        cases = [
            (await r.post(), 401, "invalid_api_key"),
            (await r.post(headers={"Authorization": "Bearer nope"}), 401, "invalid_api_key"),
            # a key not allowed the model hears exactly what an unknown model gets (no existence leak)
            (await r.post(headers={"Authorization": "Bearer sk-a"}), 404, "model_not_found"),
            (await r.post(raw=b"{", headers=ok), 400, "invalid_json"),
            (await r.post(body={"messages": []}, headers=ok), 400, "missing_model"),
            (await r.post(body={"model": "zzz"}, headers=ok), 404, "model_not_found"),
            (await r.post(raw=b'{"model":"m","p":"' + b"x" * 4096 + b'"}', headers=ok), 413, "request_too_large"),
        ]
        for (st, hdrs, body), want_status, want_code in cases:
            err = json.loads(body)["error"]
            assert (st, err["code"]) == (want_status, want_code), body
            assert set(err) == {"message", "type", "param", "code"}
        async with r.http.get(r.url + "/v1/chat/completions") as resp:
            assert resp.status == 405 and resp.headers["Allow"] == "POST"
            assert (await resp.json())["error"]["code"] == "method_not_allowed"
        async with r.http.get(r.url + "/admin/endpoints") as resp:
            assert resp.status == 404 and (await resp.json())["error"]["code"] == "unknown_url"
        async with r.http.get(r.url + "/v1/models", headers={"Authorization": "Bearer sk-a"}) as resp:
            assert (await resp.json())["data"] == []  # alice may use only "other", which has no endpoint
        async with r.http.get(r.url + "/v1/models", headers=ok) as resp:
            assert [m["id"] for m in (await resp.json())["data"]] == ["m"]
        async with r.http.get(r.url + "/v1/models") as resp:
            assert resp.status == 401
        async with r.http.get(r.url + "/healthz") as resp:
            assert resp.status == 200 and (await resp.json())["revision"] == 0
        assert len(a.requests) == 0
        assert await r.metric("llmgw_router_errors_total", **{"class": "unauthorized"}) == 3
        async with r.http.get(r.url + "/metrics", headers=SCRAPE) as resp:
            text = await resp.text()
        assert "sk-" not in text and hash_key("sk-o") not in text and "alice" not in text
    await a.stop()


@run
async def test_client_hanging_up_on_an_error_event_still_counts_against_the_engine():
    never = asyncio.Event()

    async def err(request, body):
        return await _err_then_hold(request, never)
    a = await Engine(err).start()
    async with Router(eps(a)) as r:
        async with r.http.post(r.url + "/v1/chat/completions", json={"model": "m", "stream": True}) as resp:
            seen = b""
            while b'"error"' not in seen:
                seen += await resp.content.readany()
        rt = r.routing.runtimes()[0]
        for _ in range(500):
            if rt.outstanding == 0:
                break
            await asyncio.sleep(0.01)
        assert rt.health.consecutive_failures == 1
        assert await r.metric("llmgw_router_upstream_attempts_total", outcome="inband_error") == 1
    never.set()
    await a.stop()


async def _err_then_hold(request, never):
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for part in (ROLE, chunk(0), ERR):
        await asyncio.sleep(0.05)
        await resp.write(part)
    await never.wait()
    return resp


@run
async def test_client_leaving_after_done_is_a_delivered_stream_not_a_cancellation():
    never = asyncio.Event()

    async def done_then_hold(request, body):
        # the whole stream, [DONE] included, then the engine keeps its end open a while
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for part in (ROLE, chunk(0), chunk(1), DONE):
            await resp.write(part)
        await never.wait()
        return resp
    a = await Engine(done_then_hold).start()
    async with Router(eps(a)) as r:
        async with r.http.post(r.url + "/v1/chat/completions", json={"model": "m", "stream": True}) as resp:
            seen = b""
            while not seen.endswith(DONE):
                seen += await resp.content.readany()
            resp.close()  # an SDK stops reading at [DONE] and may drop the connection at once
        assert seen == ROLE + chunk(0) + chunk(1) + DONE
        rt = r.routing.runtimes()[0]
        for _ in range(500):
            if rt.outstanding == 0:
                break
            await asyncio.sleep(0.01)
        assert rt.outstanding == 0
        assert await r.metric("llmgw_router_upstream_attempts_total", outcome="ok") == 1
        assert await r.metric("llmgw_router_upstream_attempts_total", outcome="cancelled") == 0
        assert await r.metric("llmgw_router_requests_total", status="200") == 1
        assert await r.metric("llmgw_router_requests_total", status="499") == 0
    never.set()
    await a.stop()


@run
async def test_client_leaving_before_done_is_still_a_cancellation():
    never = asyncio.Event()

    async def hold(request, body):
        return await stream(request, [chunk(0), chunk(1)], hold=never)
    a = await Engine(hold).start()
    async with Router(eps(a)) as r:
        async with r.http.post(r.url + "/v1/chat/completions", json={"model": "m", "stream": True}) as resp:
            assert (await resp.content.readany()).startswith(b"data:")
            resp.close()
        rt = r.routing.runtimes()[0]
        for _ in range(500):
            if rt.outstanding == 0:
                break
            await asyncio.sleep(0.01)
        assert await r.metric("llmgw_router_upstream_attempts_total", outcome="cancelled") == 1
        assert await r.metric("llmgw_router_requests_total", status="499") == 1
    never.set()
    await a.stop()


# ------------------------------------------------ audit fixes (2026-12-03)

async def _abandon(r, after: float):
    """A streaming client that gives up after ``after`` seconds."""
    try:
        await asyncio.wait_for(r.chat_stream(), after)
    except asyncio.TimeoutError:
        pass


@pytest.mark.parametrize("sends_head", [False, True])
@run
async def test_impatient_clients_do_not_keep_a_hung_engine_in_rotation(sends_head):
    never = asyncio.Event()

    async def hung(request, body):
        if sends_head:  # vLLM-like: the head and the role chunk, then nothing
            return await stream(request, [ROLE], hold=never)
        await never.wait()
    a = await Engine(hung).start()
    async with Router(eps(a), {"timeouts": {"first_token": 0.6},
                               "outlier": {"consecutive_errors": 2, "base_ejection": 300,
                                           "max_ejection": 300}}) as r:
        rt = r.routing.runtimes()[0]
        await _abandon(r, 0.2)
        await _abandon(r, 0.2)
        # the engine still works on them (as far as the router knows): their slots stay taken
        await until_async(lambda: len(r.app[PROXY_KEY].attempts.verdicts) == 2)
        assert rt.outstanding == 2
        await until_async(lambda: rt.outstanding == 0)
        outcome = "first_token_timeout" if sends_head else "timeout"
        assert await r.metric("llmgw_router_upstream_attempts_total", outcome=outcome) == 2
        assert await r.metric("llmgw_router_upstream_attempts_total", outcome="cancelled") == 0
        assert await r.metric("llmgw_router_ejections_total", endpoint="e0") == 1
        st, _, body = await r.chat_stream()
        assert st == 503 and json.loads(body)["error"]["code"] == "no_healthy_endpoint"
        assert not r.app[PROXY_KEY].attempts.verdicts
    never.set()
    await a.stop()


@run
async def test_client_leaving_before_the_first_token_of_a_slow_but_working_engine_is_not_a_failure():
    async def slow(request, body):
        return await stream(request, [ROLE, chunk(0), DONE], delay=0.3)
    a = await Engine(slow).start()
    async with Router(eps(a), {"timeouts": {"first_token": 5}, "outlier": {"consecutive_errors": 1}}) as r:
        rt = r.routing.runtimes()[0]
        await _abandon(r, 0.1)
        await until_async(lambda: len(r.app[PROXY_KEY].attempts.verdicts) == 1)
        assert rt.outstanding == 1  # held until the engine's first token shows it works
        await until_async(lambda: rt.outstanding == 0)
        assert await r.metric("llmgw_router_upstream_attempts_total", outcome="cancelled") == 1
        assert rt.health.consecutive_failures == 0 and not rt.health.ejections
    await a.stop()


@run
async def test_shutdown_cancels_verdict_tasks_and_closes_their_connections():
    never = asyncio.Event()
    closed = asyncio.Event()

    async def hung(request, body):
        while request.transport is not None and not request.transport.is_closing():
            await asyncio.sleep(0.02)  # never answers; notices when the router closes the connection
        closed.set()
        await never.wait()
    a = await Engine(hung).start()
    r = Router(eps(a), {"timeouts": {"first_token": 60, "per_try": 60}})
    async with r:
        await _abandon(r, 0.2)
        proxy = r.app[PROXY_KEY]
        await until_async(lambda: len(proxy.attempts.verdicts) == 1)
        t = asyncio.get_running_loop().time()
    # (the Router context's exit ran the app's cleanup)
    assert asyncio.get_running_loop().time() - t < 5
    assert not proxy.attempts.verdicts
    await asyncio.wait_for(closed.wait(), 5)
    never.set()
    await a.stop()


@pytest.mark.parametrize("stream_req", [False, True])
@run
async def test_engine_429_always_has_retry_after_and_an_openai_body(stream_req):
    async def plain_429(request, body):
        return web.Response(status=429, text="Too Many Requests", content_type="text/plain")

    async def json_429(request, body):
        return web.Response(status=429, text='{"error":{"message":"busy","type":"x","param":null,"code":429}}',
                            content_type="application/json", headers={"Retry-After": "7"})

    async def bad_retry_after(request, body):
        return web.Response(status=429, text='{"error":"busy"}', content_type="application/json",
                            headers={"Retry-After": "soon"})
    engines = [await Engine(b).start() for b in (plain_429, json_429, bad_retry_after)]
    body = {"model": "m", "messages": [], "stream": stream_req}
    for e, want_ra, want_code in [(engines[0], "1", "upstream_rate_limited"), (engines[1], "7", 429),
                                  (engines[2], "1", None)]:
        async with Router(eps(e)) as r:
            st, hdrs, raw = await r.post(body=body)
            assert st == 429 and hdrs["Retry-After"] == want_ra and hdrs["Content-Type"] == "application/json"
            err = json.loads(raw)["error"]
            if want_code is not None:
                assert err["code"] == want_code
            assert await r.metric("llmgw_router_errors_total", **{"class": "saturated"}) == 1
    for e in engines:
        await e.stop()


@run
async def test_unexpected_exception_is_an_openai_500_and_charges_the_attempt(caplog, monkeypatch):
    a = await Engine(healthy()).start()
    async with Router(eps(a)) as r:
        rt = r.routing.runtimes()[0]

        def broken_pool(self):
            raise RuntimeError("bug in the pool")
        monkeypatch.setattr(type(rt), "get_pool", broken_pool)
        caplog.set_level(logging.ERROR, "llmgw.router")
        st, hdrs, raw = await r.post(body={"model": "m", "messages": []}, headers={"X-Request-Id": "rid-42"})
        assert st == 500 and hdrs["Content-Type"] == "application/json" and hdrs["X-Request-Id"] == "rid-42"
        err = json.loads(raw)["error"]
        assert err["code"] == "internal_error" and "rid-42" in err["message"]
        assert set(err) == {"message", "type", "param", "code"}
        assert len([x for x in caplog.records if x.exc_info]) == 1 and "Traceback" in caplog.text
        assert await r.metric("llmgw_router_upstream_attempts_total", outcome="error") == 1
        assert rt.health.consecutive_failures == 1
        assert await r.metric("llmgw_router_errors_total", **{"class": "internal"}) == 1
    await a.stop()


@run
async def test_total_deadline_spends_no_retry_and_is_not_the_engines_fault():
    never = asyncio.Event()

    async def hung(request, body):
        await never.wait()
    a, b = await Engine(hung).start(), await Engine(hung).start()
    async with Router(eps(a, b), {"timeouts": {"total": 0.5, "per_try": 0.5, "first_token": 0.5}}) as r:
        st, _, raw = await r.post(body={"model": "m", "messages": []})
        assert st == 504
        proxy = r.app[PROXY_KEY]
        assert proxy.forwarder.budget.total_retries == 0
        assert await r.metric("llmgw_router_retries_total") == 0
        assert [x.health.consecutive_failures for x in r.routing.runtimes()] == [0, 0]
        assert await r.metric("llmgw_router_upstream_attempts_total") == 1
    never.set()
    await a.stop(); await b.stop()


@pytest.mark.parametrize("splice", [True, False])
@run
async def test_sse_comments_do_not_feed_the_inter_token_watchdog(splice, monkeypatch):
    if not splice:
        from llmgw.router import relay as relay_mod
        monkeypatch.setattr(relay_mod.Splice, "attach", classmethod(lambda cls, *a, **kw: None))

    async def keepalive(request, body):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chunk(0))
        try:
            for _ in range(50):
                await asyncio.sleep(0.1)
                await resp.write(b": keepalive\n\n")
        except (ConnectionError, RuntimeError):
            pass
        return resp
    a = await Engine(keepalive).start()
    async with Router(eps(a), {"timeouts": {"inter_token": 0.5}}) as r:
        t = asyncio.get_running_loop().time()
        st, _, body = await r.chat_stream()
        assert asyncio.get_running_loop().time() - t < 2.5  # not the engine's 5 s of comments
        assert st == 200 and error_event(body)["code"] == "upstream_stream_stalled"
        assert await r.metric("llmgw_router_upstream_attempts_total", outcome="inter_token_timeout") == 1
    await a.stop()


@run
async def test_done_before_any_output_is_a_broken_stream_and_retried():
    async def empty(request, body):
        return await stream(request, [ROLE, b": ping\n\n", DONE])
    a = await Engine(empty).start()
    b = await Engine(healthy(1)).start()
    async with Router(eps(a)) as r:
        st, _, raw = await r.chat_stream()
        assert st == 502 and json.loads(raw)["error"]["code"] == "upstream_stream_broken"
        assert await r.metric("llmgw_router_upstream_attempts_total", outcome="broken") == 1
    async with Router(eps(a, b)) as r:
        for _ in range(20):
            st, _, raw = await r.chat_stream()
            assert st == 200 and raw == ROLE + chunk(0) + DONE
            if await r.metric("llmgw_router_retries_total", reason="broken"):
                break
        assert await r.metric("llmgw_router_retries_total", reason="broken") == 1
    await a.stop(); await b.stop()


@run
async def test_gets_and_fallback_answers_are_access_logged_with_a_request_id(caplog):
    a = await Engine(healthy()).start()
    caplog.set_level(logging.INFO, "llmgw.router.access")
    async with Router(eps(a), {"access_log": True}) as r:
        for method, path, want in [("GET", "/v1/models", 200), ("GET", "/v1/models/m", 200),
                                   ("GET", "/v1/models/zzz", 404), ("GET", "/nope", 404),
                                   ("DELETE", "/v1/models", 405), ("GET", "/v1/chat/completions", 405)]:
            rid = f"rid-{method}-{want}-{len(path)}"
            async with r.http.request(method, r.url + path, headers={"X-Request-Id": rid}) as resp:
                assert resp.status == want and resp.headers["X-Request-Id"] == rid
            assert f'rid={rid} key=- "{method} {path}"' in caplog.text
            assert f"status={want}" in caplog.text.split(f"rid={rid}")[1].splitlines()[0]
        async with r.http.get(r.url + "/v1/models") as resp:
            assert len(resp.headers["X-Request-Id"]) == 24
        st, _, _ = await r.post(body={"model": "m", "prompt": "hi"}, headers={"X-Request-Id": "rid-served"})
        assert st == 200
        served = caplog.text.split("rid=rid-served")[1].splitlines()[0]
        # the time before the first upstream try, within the request's whole time
        wait, dur = (float(re.search(rf" {f}=([\d.]+)", served)[1]) for f in ("wait_ms", "dur_ms"))
        assert 0 <= wait <= dur, served
        assert "wait_ms=-" in caplog.text.split("rid=rid-GET-404-5")[1].splitlines()[0]  # refused before it
        n = caplog.text.count("rid=")
        async with r.http.get(r.url + "/healthz") as resp:
            assert resp.status == 200
        assert caplog.text.count("rid=") == n  # /healthz (and /metrics) stay out of the log
    await a.stop()


@run
async def test_a_forbidden_model_is_indistinguishable_from_an_unknown_one():
    a = await Engine(healthy()).start()
    doc = {"allow_unauthenticated": False,
           "api_keys": [{"name": "alice", "sha256": hash_key("sk-a"), "models": ["other"]}]}
    async with Router(eps(a), doc) as r:
        h = {"Authorization": "Bearer sk-a"}
        st1, _, b1 = await r.post(body={"model": "m"}, headers=h)
        st2, _, b2 = await r.post(body={"model": "q"}, headers=h)
        assert st1 == st2 == 404
        assert json.loads(b1) == {"error": {
            "message": "The model `m` does not exist or you do not have access to it.",
            "type": "invalid_request_error", "param": None, "code": "model_not_found"}}
        assert b1.replace(b"`m`", b"`q`") == b2
        for name in ("m", "q"):
            async with r.http.get(r.url + f"/v1/models/{name}", headers=h) as resp:
                assert resp.status == 404
                assert (await resp.json())["error"]["message"] == \
                    f"The model `{name}` does not exist or you do not have access to it."
        assert await r.metric("llmgw_router_errors_total", **{"class": "forbidden"}) == 0
        assert len(a.requests) == 0
    await a.stop()


@run
async def test_relayed_streams_leave_no_cyclic_garbage():
    """Each stream's relay objects are freed by reference counting when it ends.

    Cycles among them (the splice holds its watchdog, whose poison was the splice's own
    bound method) left every stream's splice, watchdog, timer handle and writer to the
    cyclic collector, whose pauses then landed in the latency of the streams in flight.
    """
    a = await Engine(healthy(4, delay=0.01)).start()
    async with Router(eps(a)) as r:
        await r.chat_stream()  # imports and lazily built state are not the relay's garbage
        gc.collect()
        gc.disable()
        try:
            for _ in range(5):
                st, _, body = await r.chat_stream()
                assert st == 200 and body.endswith(DONE)
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            ours = sorted({type(o).__name__ for o in gc.garbage if type(o).__module__.startswith("llmgw.router")})
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
    await a.stop()
    assert ours == []
