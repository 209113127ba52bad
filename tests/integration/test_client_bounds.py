"""Bounded clients, through real processes: the router binary and ``llmgw server``.

A client that opens connections and never finishes a request head, or holds
a body one byte short, used to keep its descriptor and its buffers for as
long as it liked: 2,000 such connections took a control plane with 1,024
descriptors off the air, and 20 held 15 MiB bodies added 463 MiB to the
router.  The deadlines are configured short here; every wait is on a
condition.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess
import threading
import time

import httpx
import pytest

from fleet import ADMIN_TOKEN, Fleet, until
from llmgw.router.auth import hash_key
from llmgw.tls.context import client_context
from tests.support.procfs import rss_kib
from router_support import RouterProcess, openai_client, router_doc, start_sims

pytestmark = pytest.mark.integration

HOST = "127.0.0.1"
MSG = [{"role": "user", "content": "hello"}]
HALF_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"  # no blank line: the head never ends


async def _open(port: int, n: int, data: bytes, local: str | None = None,
                ctx: ssl.SSLContext | None = None) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    conns = []
    for _ in range(n):
        r, w = await asyncio.open_connection(HOST, port, local_addr=(local, 0) if local else None, ssl=ctx,
                                             server_hostname="localhost" if ctx else None)
        if data:
            w.write(data)
        conns.append((r, w))
    return conns


async def _until_closed(reader: asyncio.StreamReader) -> bytes:
    """What the server sent before it closed the connection."""
    out = b""
    try:
        while chunk := await reader.read(65536):
            out += chunk
    except (ConnectionError, ssl.SSLError):
        pass
    return out


def _serve_throughout(call, stop: threading.Event) -> list:
    """Call ``call()`` in a thread until ``stop``; returns the results (exceptions included)."""
    results: list = []

    def loop():
        while not stop.is_set():
            try:
                results.append(call())
            except Exception as e:  # noqa: BLE001 - recorded, asserted on
                results.append(e)
    t = threading.Thread(target=loop, daemon=True)
    results.append(t)  # first, before the thread can append its first result
    t.start()
    return results


def test_router_closes_2000_unfinished_heads_within_the_deadline_while_serving_others(tmp_path):
    (sim,) = start_sims(1)
    doc = router_doc([{"id": "e", "model": "m", "url": sim.url}],
                     clients={"head_timeout": 1, "max_connections_per_source": 0})
    try:
        with RouterProcess(doc, tmp=tmp_path) as router:
            client = openai_client(router, timeout=30)

            def one():
                return client.chat.completions.create(model="m", messages=MSG, max_tokens=2).choices[0].message

            async def attack():
                conns = await _open(router.port, 2000, HALF_HEAD)
                stop = threading.Event()
                served = _serve_throughout(one, stop)
                try:
                    sent = await asyncio.wait_for(
                        asyncio.gather(*(_until_closed(r) for r, _ in conns)), 60)
                finally:
                    stop.set()
                    served[0].join(60)
                for _, w in conns:
                    w.close()
                return sent, served[1:]

            sent, served = asyncio.run(attack())
            assert sent == [b""] * 2000  # closed, nothing answered to a head that never ended
            assert served and all(not isinstance(x, Exception) for x in served), served[:3]
            assert one() is not None
    finally:
        sim.stop()


def test_router_held_bodies_cost_at_most_the_cap_and_are_cut(tmp_path):
    mib = 1 << 20
    cap = 32 * mib
    doc = router_doc([{"id": "e", "model": "m", "url": "http://127.0.0.1:9"}],
                     limits={"max_body_bytes": 16 * mib},
                     clients={"max_body_bytes_per_source": cap, "max_requests_per_source": 0,
                              "body_grace": 8, "body_min_rate": 64 * mib})
    # body_grace outlasts the time it takes to send the 20 heads (300 MiB of bodies from one loop): on
    # a loaded machine, with 2 s, the first two admitted were cut before the last heads arrived, and
    # those then found the cap free again.
    size = 15 * mib
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % size)
    body = b"{" + b" " * (size - 2)  # one byte short of the declared length
    with RouterProcess(doc, tmp=tmp_path) as router:
        router.get("/healthz")
        before = rss_kib(router.proc.pid)
        peak = [before]
        done = threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], rss_kib(router.proc.pid))
                time.sleep(0.02)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()

        async def hold(i: int) -> bytes:
            r, w = await asyncio.open_connection(HOST, router.port)
            try:
                w.write(head + body)
                await w.drain()
            except ConnectionError:
                pass  # refused at its head: the router closed without reading the body
            out = await asyncio.wait_for(_until_closed(r), 60)
            w.close()
            return out

        async def attack():
            return await asyncio.gather(*(hold(i) for i in range(20)))

        try:
            answers = asyncio.run(attack())
        finally:
            done.set()
            sampler.join(10)
        statuses = [a.split(b" ", 2)[1] if a.startswith(b"HTTP/1.1 ") else b"reset" for a in answers]
        assert set(statuses) <= {b"429", b"408", b"reset"}, statuses
        assert statuses.count(b"408") <= cap // size, statuses  # admitted: no more than the cap holds, then cut
        # the others were refused at their head (their 429 may be lost to the reset of an unread body)
        assert "source over its cap of 33554432 bytes of request bodies in flight" in router.output()
        grown = (peak[0] - before) * 1024
        # a body being read grows a buffer by copying it: up to twice the reserved bytes at a moment
        # (measured 49-57 MiB for 30 MiB held; 20 bodies held without the cap: over 300 MiB)
        assert grown <= 2 * cap + 16 * mib, f"router grew {grown / mib:.0f} MiB holding bodies (cap {cap / mib:.0f})"
        assert router.get("/healthz")  # still serving; every reservation released
        with httpx.Client(timeout=30) as c:
            r = c.post(router.url + "/v1/chat/completions", content=b"x" * (15 * mib))
            assert r.status_code == 400  # admitted (not 429): the cut bodies gave their bytes back


MIB = 1 << 20
SCRAPE_TOKEN = "prometheus-scrape-token"


def _keyed(endpoints: list[dict], limits: dict, clients: dict) -> dict:
    return router_doc(endpoints, allow_unauthenticated=False, limits=limits, clients=clients,
                      api_keys=[{"name": k, "sha256": hash_key(f"sk-{k}")} for k in ("k1", "k2")],
                      metrics_tokens=[{"name": "prometheus", "sha256": hash_key(SCRAPE_TOKEN)}])


def _head(key: str | None, framing: bytes) -> bytes:
    auth = b"Authorization: Bearer sk-%s\r\n" % key.encode() if key else b""
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%s%s\r\n"
            % (auth, framing))


def _declared(key: str | None, size: int) -> bytes:
    return _head(key, b"Content-Length: %d\r\n" % size)


def _chunked(key: str | None) -> bytes:
    return _head(key, b"Transfer-Encoding: chunked\r\n")


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


async def _answer(reader: asyncio.StreamReader) -> tuple[int, dict]:
    """Status and OpenAI error of one answer, read as soon as it is whole.

    Not at the close: after answering a request whose body it did not read, aiohttp reads and
    discards what the client still sends for up to 10 s (lingering close) before it closes.
    """
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    body = await asyncio.wait_for(reader.readexactly(length), 60)
    return _status(head), json.loads(body)["error"]


def _post(router: RouterProcess, key: str, body: bytes) -> httpx.Response:
    with httpx.Client(timeout=30) as c:
        return c.post(router.url + "/v1/chat/completions", content=body,
                      headers={"Authorization": f"Bearer sk-{key}", "Content-Type": "application/json"})


def _refused_until(router: RouterProcess, key: str, body: bytes, cap: str) -> int:
    """Post until one answer is the 429 of ``cap``'s owner ("key" or "source"); the 429s seen."""
    seen = 0

    def refused():
        nonlocal seen
        r = _post(router, key, body)
        if r.status_code != 429:
            return False
        seen += 1
        err = r.json()["error"]
        assert r.headers["Retry-After"] == "1" and err["code"] == "rate_limit_exceeded", r.text
        return f"for this {cap}" in err["message"]
    until(refused, f"a 429 from the {cap} cap", 60, interval=0.02)
    return seen


def test_router_counts_the_requests_its_caps_refuse_by_the_cap(tmp_path):
    """Refused by a client cap: in requests_total (model "-", 429) and in errors_total under the cap's name."""
    doc = _keyed([{"id": "e", "model": "m", "url": "http://127.0.0.1:9"}], {"max_body_bytes": MIB},
                 {"max_requests_per_key": 1, "max_requests_per_source": 0, "max_body_bytes_per_key": 0,
                  "max_body_bytes_per_source": MIB, "body_grace": 60})
    with RouterProcess(doc, tmp=tmp_path) as router:
        router.metrics_token = SCRAPE_TOKEN

        async def scenario():
            # k1 holds its one request, a body one byte in: its next requests are over the key's cap
            (r1, w1), = await _open(router.port, 1, _declared("k1", 100) + b"{")
            by_key = await asyncio.to_thread(_refused_until, router, "k1", b"{}", "key")
            # k2 holds the rest of the address's body bytes: anything more from it is over the source's cap
            (r2, w2), = await _open(router.port, 1, _declared("k2", MIB - 100) + b"{")
            by_source = await asyncio.to_thread(_refused_until, router, "k2", b"{}", "source")
            for w in (w1, w2):
                w.close()
            return by_key, by_source

        by_key, by_source = asyncio.run(scenario())
        assert router.metric("llmgw_router_errors_total", model="-", **{"class": "max_requests_per_key"}) == by_key
        assert router.metric("llmgw_router_errors_total", model="-",
                             **{"class": "max_body_bytes_per_source"}) == by_source
        assert router.metric("llmgw_router_requests_total", model="-", status="429") == by_key + by_source
        assert router.metric("llmgw_router_request_duration_seconds_count", model="-") >= by_key + by_source
        text = router.get("/metrics", headers={"Authorization": f"Bearer {SCRAPE_TOKEN}"}).decode()
        assert "k1" not in text and "k2" not in text and '"127.0.0.1"' not in text  # no key, no address


def test_router_counts_bodies_cut_by_the_deadline_and_chunked_bodies_over_the_limit(tmp_path):
    doc = _keyed([{"id": "e", "model": "m", "url": "http://127.0.0.1:9"}], {"max_body_bytes": 64 * 1024},
                 {"body_grace": 0.5, "body_min_rate": MIB})
    with RouterProcess(doc, tmp=tmp_path) as router:
        router.metrics_token = SCRAPE_TOKEN

        async def scenario():
            (r1, w1), = await _open(router.port, 1, _declared("k1", 1000) + b"{")  # held one byte in
            # over the limit with its last byte, and nothing after it: every byte sent is read
            (r2, w2), = await _open(router.port, 1, _chunked("k1") + b"%x\r\n" % (64 * 1024 + 1) + b"x" * (64 * 1024 + 1))
            out = await asyncio.gather(_answer(r1), _answer(r2))
            for w in (w1, w2):
                w.close()
            return out

        (slow, slow_err), (large, large_err) = asyncio.run(scenario())
        assert slow == 408 and slow_err["code"] == "request_timeout", slow_err
        assert large == 413 and large_err["code"] == "request_too_large", large_err
        assert router.metric("llmgw_router_requests_total", model="-", status="408") == 1
        assert router.metric("llmgw_router_errors_total", model="-", **{"class": "body_timeout"}) == 1
        assert router.metric("llmgw_router_requests_total", model="-", status="413") == 1
        assert router.metric("llmgw_router_errors_total", model="-", **{"class": "too_large"}) == 1


def test_router_reserves_a_chunked_body_as_it_arrives_and_releases_it(tmp_path):
    """Chunked bodies used to reserve limits.max_body_bytes each: one held the whole of a key's byte cap."""
    (sim,) = start_sims(1)
    doc = _keyed([{"id": "e", "model": "m", "url": sim.url}], {"max_body_bytes": MIB},
                 {"max_requests_per_key": 0, "max_requests_per_source": 0, "max_body_bytes_per_key": MIB,
                  "max_body_bytes_per_source": 0, "body_grace": 60})
    body = json.dumps({"model": "m", "messages": MSG, "max_tokens": 2}).encode()
    try:
        with RouterProcess(doc, tmp=tmp_path) as router:
            async def scenario():
                # eight chunked bodies of one key, ten bytes in each, all held at once
                held = await _open(router.port, 8, _chunked("k1") + _chunk(body[:10]))
                probe = await asyncio.to_thread(_post, router, "k1", body)  # and a declared body beside them
                assert probe.status_code == 200, probe.text
                answers = []
                for r, w in held:
                    w.write(_chunk(body[10:]) + b"0\r\n\r\n")
                    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 60)
                    answers.append(_status(head))
                    w.close()
                assert answers == [200] * 8, answers
                # a chunked body that crosses the key's cap mid-body, with another one holding most of it
                (r1, w1), = await _open(router.port, 1, _chunked("k1") + _chunk(b"{" + b" " * (MIB - 1000)))
                until_refused = await asyncio.to_thread(_refused_until, router, "k1", b" " * 2000, "key")
                assert until_refused >= 1
                (r2, w2), = await _open(router.port, 1, _chunked("k1") + _chunk(b"{"))  # admitted: one byte
                w2.write(_chunk(b" " * 2000))  # crosses the cap
                status, err = await _answer(r2)
                assert status == 429 and "for this key" in err["message"], err
                for w in (w1, w2):
                    w.close()

            asyncio.run(scenario())
            # every reservation was given back: a body of the whole cap is admitted (and is not JSON)
            until(lambda: _post(router, "k1", b"x" * (MIB - 1)).status_code == 400, "the cap to be free again", 60)
    finally:
        sim.stop()


def test_router_cuts_a_chunked_body_that_falls_behind_the_minimum_rate_for_what_it_sent(tmp_path):
    """A chunked body's deadline used to be the one of a body of limits.max_body_bytes (here over
    1,000 s): ten bytes then silence held the connection that long. Now it is body_grace plus what
    the body sent at body_min_rate, so it is cut, while one that keeps up past body_grace is read whole."""
    doc = _keyed([{"id": "e", "model": "m", "url": "http://127.0.0.1:9"}], {"max_body_bytes": MIB},
                 {"body_grace": 0.5, "body_min_rate": 1024})
    with RouterProcess(doc, tmp=tmp_path) as router:
        router.metrics_token = SCRAPE_TOKEN

        async def scenario():
            (r1, w1), = await _open(router.port, 1, _chunked("k1") + _chunk(b"{" + b" " * 9))  # then silence
            (r2, w2), = await _open(router.port, 1, _chunked("k1") + _chunk(b" " * 2048))
            # 2 KiB every 0.1 s, twenty times the minimum rate, for longer than body_grace: the
            # deadline keeps moving ahead of it
            for _ in range(10):
                await asyncio.sleep(0.1)
                w2.write(_chunk(b" " * 2048))
            w2.write(_chunk(b"x") + b"0\r\n\r\n")  # whole, and not JSON: the proxy's 400
            out = await asyncio.gather(_answer(r1), _answer(r2))
            for w in (w1, w2):
                w.close()
            return out

        (slow, slow_err), (steady, steady_err) = asyncio.run(scenario())
        assert slow == 408 and slow_err["code"] == "request_timeout", slow_err
        assert steady == 400 and steady_err["code"] == "invalid_json", steady_err
        assert router.metric("llmgw_router_errors_total", model="-", **{"class": "body_timeout"}) == 1


def _cp(tmp_path, clients: dict) -> Fleet:
    f = Fleet(tmp_path / "fleet", {})
    if clients:
        f.config["api"]["clients"] = clients
        f.write_config()
    return f


def test_control_plane_answers_admins_with_1024_descriptors_while_2000_connections_hang(tmp_path):
    with _cp(tmp_path, {"head_timeout": 2, "max_connections_per_source": 64}) as f:
        f.start(agents=False)
        subprocess.run(["prlimit", f"--pid={f.server.pid}", "--nofile=1024:1024"], check=True)
        admin = f.client()

        def nodes():
            return admin.get("/v1/nodes").status_code

        async def attack():
            # TCP only, from another loopback address: not even a ClientHello
            conns = await _open(f.port, 2000, b"", local="127.0.0.2")
            stop = threading.Event()
            served = _serve_throughout(nodes, stop)
            try:
                sent = await asyncio.wait_for(asyncio.gather(*(_until_closed(r) for r, _ in conns)), 60)
            finally:
                stop.set()
                served[0].join(60)
            for _, w in conns:
                w.close()
            return sent, served[1:]

        sent, served = asyncio.run(attack())
        assert len(sent) == 2000  # every one closed: over the cap at once, the rest at the handshake deadline
        assert served and set(served) == {200}, served[:3]
        assert nodes() == 200
        assert "more than 64 connections from this address" in f.server.output(last=1 << 30)
        admin.close()


def test_control_plane_does_not_count_verified_certificates_against_their_address(tmp_path):
    """Agents behind one NAT address each present a certificate: the per-address cap must not cap the fleet."""
    with _cp(tmp_path, {"max_connections_per_source": 4}) as f:
        f.start(agents=False)
        clients = [f.client() for _ in range(12)]  # each keeps its own connection open (keep-alive)
        try:
            assert [c.get("/v1/nodes").status_code for c in clients] == [200] * 12
            assert [c.get("/v1/nodes").status_code for c in clients] == [200] * 12  # and they stayed open
        finally:
            for c in clients:
                c.close()
        assert "more than 4 connections from this address" not in f.server.output(last=1 << 30)


def test_control_plane_closes_anonymous_connections_that_do_not_authenticate(tmp_path):
    with _cp(tmp_path, {"head_timeout": 60, "anonymous_timeout": 1, "body_grace": 1}) as f:
        f.start(agents=False)
        anon = client_context(f.pki.ca_cert)
        request = b"GET %s HTTP/1.1\r\nHost: x\r\n%s\r\n"

        async def ask(r, w, path: bytes, auth: bytes = b"") -> bytes:
            w.write(request % (path, auth))
            head = await r.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await r.readexactly(length)
            return head.split(b" ", 2)[1]

        async def scenario():
            (r1, w1), (r2, w2) = await _open(f.port, 2, b"", ctx=anon)
            token = b"Authorization: Bearer %s\r\n" % ADMIN_TOKEN.encode()
            assert await ask(r2, w2, b"/v1/nodes", token) == b"200"
            # the head deadline is a minute: only the anonymous deadline can close r1, busy as it is
            answered = 0
            with pytest.raises((asyncio.IncompleteReadError, ConnectionError, ssl.SSLError)):
                for _ in range(10000):
                    assert await ask(r1, w1, b"/healthz") == b"200"
                    answered += 1
                    await asyncio.sleep(0.05)
            assert answered > 0
            # the authenticated one outlived it and still serves
            assert await ask(r2, w2, b"/v1/nodes", token) == b"200"
            # a body held short is cut, after the admin check
            w2.write(b"POST /v1/reload HTTP/1.1\r\nHost: x\r\n%sContent-Length: 100\r\n\r\n{" % token)
            out = await asyncio.wait_for(_until_closed(r2), 60)
            assert out.startswith(b"HTTP/1.1 408"), out[:200]
            for w in (w1, w2):
                w.close()

        asyncio.run(scenario())


def test_control_plane_logs_a_refused_admin_request_once_per_peer_and_reason(tmp_path):
    with _cp(tmp_path, {}) as f:
        f.start(agents=False)
        with httpx.Client(base_url=f.url, verify=client_context(f.pki.ca_cert), timeout=30) as c:
            for _ in range(200):
                assert c.get("/v1/nodes").status_code == 401
            assert c.get("/v1/nodes", headers={"Authorization": "Bearer nope"}).status_code == 403
        until(lambda: "unknown admin token" in f.server.output(), "the second reason logged")
        out = f.server.output()
        assert out.count("refused GET /v1/nodes") == 2, out[-3000:]  # one line for each reason
