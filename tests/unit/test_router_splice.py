"""The splice: committed streams relayed from the upstream connection's read callback.

Real sockets, one process, scripted engines (see test_router_proxy.py).
Every test checks that the splice really carried the stream (``attached``),
so that a fallback to the ordinary read/write loop cannot make them pass
vacuously.  The client reads with ``readchunk``, which returns each HTTP
chunk the router wrote: every one must end on an event boundary.
"""

from __future__ import annotations

import asyncio
import collections
import json

import pytest
from prometheus_client import CollectorRegistry, Histogram

from llmgw.router import splice as splice_mod
from llmgw.router.metrics import BatchedHistogram
from tests.support.polling import run_async as run
from proxy_harness import DONE, ROLE, Engine, Router, chunk, eps, error_event, events, stream


@pytest.fixture
def attached(monkeypatch):
    """Every Splice the router attached during the test (None where it stayed on the ordinary loop)."""
    seen: list = []
    orig = splice_mod.Splice.attach.__func__

    def spy(cls, *a, **kw):
        s = orig(cls, *a, **kw)
        seen.append(s)
        return s
    monkeypatch.setattr(splice_mod.Splice, "attach", classmethod(spy))
    return seen


async def read_chunks(r, body=None, pause: float = 0.0) -> list[bytes]:
    """The HTTP chunks of a streamed answer, as the router wrote them."""
    async with r.http.post(r.url + "/v1/chat/completions",
                           json=body or {"model": "m", "stream": True}) as resp:
        assert resp.status == 200
        if pause:
            await asyncio.sleep(pause)
        out, cur = [], b""
        while True:
            data, end = await resp.content.readchunk()
            if not data and not end:
                break
            cur += data
            if end:
                out.append(cur)
                cur = b""
        if cur:
            out.append(cur)
        return out


def parts_of(event: bytes, n: int) -> list[bytes]:
    step = len(event) // n + 1
    return [event[i:i + step] for i in range(0, len(event), step)]


@run
async def test_event_split_across_reads_is_forwarded_whole(attached):
    """An event that reaches the router in several reads reaches the client in one piece."""
    async def trickles(request, body):
        parts = [ROLE, chunk(0), *parts_of(chunk(1), 4), chunk(2)[:10], chunk(2)[10:] + chunk(3), DONE]
        return await stream(request, parts, delay=0.03)
    a = await Engine(trickles).start()
    async with Router(eps(a)) as r:
        chunks = await read_chunks(r)
    assert attached and attached[0] is not None
    assert b"".join(chunks) == ROLE + chunk(0) + chunk(1) + chunk(2) + chunk(3) + DONE
    assert all(c.endswith(b"\n\n") for c in chunks), chunks
    assert chunk(1) in chunks  # written once whole, not as the pieces it came in
    await a.stop()


@run
async def test_break_mid_event_forwards_no_half_event_and_ends_with_error_event(attached):
    async def breaks(request, body):
        return await stream(request, [ROLE, chunk(0), chunk(1), chunk(2)[:-20]], delay=0.03, abort=True)
    a = await Engine(breaks).start()
    async with Router(eps(a)) as r:
        chunks = await read_chunks(r)
        assert await r.metric("llmgw_router_upstream_attempts_total", endpoint="e0", outcome="broken") == 1
    assert attached and attached[0] is not None
    body = b"".join(chunks)
    assert all(c.endswith(b"\n\n") for c in chunks), chunks
    evs = events(body)
    assert evs[:3] == [ROLE, chunk(0), chunk(1)]
    assert b"\"t2\"" not in body  # the half event is dropped
    assert error_event(body)["code"] == "upstream_stream_broken"
    assert evs[-1] == DONE and len(evs) == 5
    await a.stop()


@run
async def test_stream_ending_without_done_after_splice_is_an_error(attached):
    async def short(request, body):
        return await stream(request, [ROLE, chunk(0), chunk(1)], delay=0.03)
    a = await Engine(short).start()
    async with Router(eps(a)) as r:
        body = b"".join(await read_chunks(r))
    assert attached and attached[0] is not None
    assert events(body)[:3] == [ROLE, chunk(0), chunk(1)]
    assert error_event(body)["code"] == "upstream_stream_broken" and body.endswith(DONE)
    await a.stop()


@run
async def test_inband_error_seen_by_the_splice_counts_against_the_engine(attached):
    err = b'data: {"error":{"message":"EngineCore died","type":"InternalServerError","param":null,"code":500}}\n\n'

    async def fails(request, body):
        return await stream(request, [ROLE, chunk(0), chunk(1), err], delay=0.03)
    a = await Engine(fails).start()
    async with Router(eps(a)) as r:
        body = b"".join(await read_chunks(r))
        assert await r.metric("llmgw_router_upstream_attempts_total", outcome="inband_error") == 1
    assert attached and attached[0] is not None
    assert body == ROLE + chunk(0) + chunk(1) + err + DONE  # relayed as sent, then closed with [DONE]
    await a.stop()


@run
async def test_watchdog_cuts_a_spliced_stream_that_stalls(attached):
    never = asyncio.Event()

    async def stalls(request, body):
        return await stream(request, [chunk(0), chunk(1)], hold=never)  # holds after the first part
    a = await Engine(stalls).start()
    async with Router(eps(a), {"timeouts": {"inter_token": 0.3}}) as r:
        body = b"".join(await read_chunks(r))
        assert await r.metric("llmgw_router_upstream_attempts_total", outcome="inter_token_timeout") == 1
    assert attached and attached[0] is not None
    assert events(body)[0] == chunk(0)
    assert error_event(body)["code"] == "upstream_stream_stalled" and body.endswith(DONE)
    never.set()
    await a.stop()


@run
async def test_slow_client_pauses_the_upstream_and_loses_nothing(attached):
    """A client that does not read fills the router's send buffer: upstream reading pauses,
    and the wait is not the engine's silence (the inter-token watchdog would cut at 0.3 s)."""
    filler = "x" * 4000
    big = [b'data: {"choices":[{"index":0,"delta":{"content":"%d%s"}}]}\n\n' % (i, filler.encode())
           for i in range(5000)]  # 20 MB: more than the loopback socket buffers hold

    async def floods(request, body):
        await asyncio.sleep(0)
        return await stream(request, [ROLE, chunk(0)] + big + [DONE])
    a = await Engine(floods).start()
    async with Router(eps(a), {"timeouts": {"inter_token": 0.3}}) as r:
        chunks = await read_chunks(r, pause=1.0)
        assert await r.metric("llmgw_router_upstream_attempts_total", outcome="ok") == 1
    s = [x for x in attached if x is not None]
    assert s and s[0].pauses >= 1
    assert b"".join(chunks) == ROLE + chunk(0) + b"".join(big) + DONE
    assert all(c.endswith(b"\n\n") for c in chunks)
    await a.stop()


@run
async def test_upstream_connection_is_reused_after_a_spliced_stream(attached):
    """A spliced stream leaves its connection reusable: it goes back to the pool."""
    peers: list = []

    async def tracks(request, body):
        peers.append(request.transport.get_extra_info("peername"))
        return await stream(request, [ROLE, chunk(0), chunk(1), DONE], delay=0.02)
    a = await Engine(tracks).start()
    async with Router(eps(a)) as r:
        for _ in range(3):
            assert b"".join(await read_chunks(r)) == ROLE + chunk(0) + chunk(1) + DONE
        assert await r.metric("llmgw_router_upstream_attempts_total", outcome="ok") == 3
    assert len(attached) == 3 and all(s is not None for s in attached)
    assert len(set(peers)) == 1  # one keep-alive connection served all three
    await a.stop()


@run
async def test_client_leaving_a_spliced_stream_releases_the_endpoint(attached):
    never = asyncio.Event()

    async def slow(request, body):
        return await stream(request, [chunk(0), chunk(1)], hold=never)  # holds after the first part
    a = await Engine(slow).start()
    async with Router(eps(a)) as r:
        async with r.http.post(r.url + "/v1/chat/completions", json={"model": "m", "stream": True}) as resp:
            got = b""
            while chunk(0) not in got:
                got += await resp.content.readany()
            await asyncio.sleep(0.1)
        rt = r.routing.runtimes()[0]
        for _ in range(500):
            if rt.outstanding == 0 and await r.metric("llmgw_router_active_streams") == 0:
                break
            await asyncio.sleep(0.01)
        assert rt.outstanding == 0 and await r.metric("llmgw_router_active_streams") == 0
        assert not rt.health.consecutive_failures
    assert attached and attached[0] is not None
    never.set()
    await a.stop()


# ---------------------------------------------------------------- BatchedHistogram

def test_batched_histogram_adds_up_to_what_observe_would():
    reg = CollectorRegistry()
    buckets = (0.001, 0.01, 0.1, 1.0)
    batched = Histogram("b", "x", ["m"], buckets=buckets, registry=reg).labels("m")
    direct = Histogram("d", "x", ["m"], buckets=buckets, registry=reg).labels("m")
    values = [0.0, 0.0005, 0.001, 0.002, 0.01, 0.05, 0.5, 1.0, 3.0, 0.001]

    def snapshot(name):
        out = collections.Counter()
        for fam in reg.collect():
            if fam.name == name:
                for s in fam.samples:
                    suffix = s.name[len(name):]
                    if suffix != "_created":
                        out[(suffix, s.labels.get("le"))] = round(s.value, 9)
        return out

    h = BatchedHistogram(batched, now=0.0, interval=1.0)
    for i, v in enumerate(values[:5]):
        h.observe(v, 0.1 * i)  # within the first second: nothing reaches the child yet
        direct.observe(v)
    assert snapshot("b")[("_count", None)] == 0
    h.observe(values[5], 1.2)  # the second passed: everything so far goes in
    direct.observe(values[5])
    assert snapshot("b")[("_count", None)] == 6
    for v in values[6:]:
        h.observe(v, 1.3)
        direct.observe(v)
    h.flush(1.4)  # the stream's end
    assert snapshot("b") == snapshot("d")
    h.flush(1.5)  # nothing pending: no change
    assert snapshot("b") == snapshot("d")
