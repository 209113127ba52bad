"""Refused TLS handshakes: what the log says, and how often."""

from __future__ import annotations

import logging
import ssl

from llmgw.controlplane import tlssite
from llmgw import clientbounds
from llmgw.controlplane.admission import DROP, RUN, WAIT
from llmgw.controlplane.tlssite import _refusal_log, refusal_reason


def test_reason_names_the_verifiers_complaint_not_openssls_source_line():
    e = ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed (_ssl.c:1006)")
    e.verify_message = "certificate has expired"
    assert refusal_reason(e) == "client certificate refused: certificate has expired"
    plain = ssl.SSLError(1, "[SSL: TLSV1_ALERT_PROTOCOL_VERSION] alert (_ssl.c:1006)")
    plain.reason = "UNSUPPORTED_PROTOCOL"
    assert refusal_reason(plain) == "TLS handshake failed: UNSUPPORTED_PROTOCOL"
    assert refusal_reason(TimeoutError()) == "TLS handshake timed out"


def test_one_line_per_peer_and_reason_a_minute(caplog, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(clientbounds.time, "monotonic", lambda: now[0])
    refused = _refusal_log()
    with caplog.at_level(logging.WARNING, logger="llmgw.controlplane.tls"):
        for port in range(50):  # a scanner retrying from one address
            refused(("10.0.0.9", 40000 + port), "client certificate refused: self-signed certificate")
        refused(("10.0.0.9", 41000), "client certificate refused: certificate has expired")
        refused(("10.0.0.7", 41000), "client certificate refused: self-signed certificate")
        now[0] += 61
        refused(("10.0.0.9", 42000), "client certificate refused: self-signed certificate")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "TLS connection from 10.0.0.9:40000 refused: client certificate refused: self-signed certificate",
        "TLS connection from 10.0.0.9:41000 refused: client certificate refused: certificate has expired",
        "TLS connection from 10.0.0.7:41000 refused: client certificate refused: self-signed certificate",
        "TLS connection from 10.0.0.9:42000 refused: client certificate refused: self-signed certificate",
    ]


def test_a_handshake_that_times_out_is_told_and_one_whose_peer_hangs_up_is_not(tmp_path):
    """A timed-out handshake is an agent the control plane was too busy for (it holds the startup
    grace); a peer that connects and closes (a TCP health check) is nobody arriving."""
    import asyncio

    from aiohttp import web

    from llmgw.tls.ca import init_ca
    from llmgw.tls.context import server_context
    from llmgw.tls.files import write_pair
    from llmgw.tls.issue import issue_server

    ca = init_ca(tmp_path / "ca")
    server = write_pair(tmp_path / "server", *issue_server(ca, ["localhost"], ["127.0.0.1"]))
    ctx = server_context(ca.cert_path, *server)
    timed_out: list[None] = []

    async def run() -> None:
        runner = web.AppRunner(web.Application())
        await runner.setup()
        site = tlssite.HandshakeLoggingSite(runner, "127.0.0.1", 0, ssl_context=ctx, handshake_timeout=0.3,
                                            timed_out=lambda: timed_out.append(None))
        await site.start()
        port = site.addresses[0][1]
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()  # hangs up before a word
            await asyncio.sleep(0.6)
            assert timed_out == []
            _, w = await asyncio.open_connection("127.0.0.1", port)  # connects, says nothing
            await asyncio.sleep(0.8)
            assert timed_out == [None]
            w.close()
        finally:
            await runner.cleanup()

    asyncio.run(run())


def test_load_shedding_weighs_each_connection_against_the_handshakes_under_way_and_drops_it_unread(tmp_path):
    """The site counts the handshakes it runs (one whose peer hangs up before it begins
    included) and asks ``shed`` about each new connection with that count; a connection shed is
    closed before the site reads a byte of it."""
    import asyncio

    from aiohttp import web

    from llmgw.tls.ca import init_ca
    from llmgw.tls.context import server_context
    from llmgw.tls.files import write_pair
    from llmgw.tls.issue import issue_server

    ca = init_ca(tmp_path / "ca")
    server = write_pair(tmp_path / "server", *issue_server(ca, ["localhost"], ["127.0.0.1"]))
    ctx = server_context(ca.cert_path, *server)
    asked: list[int] = []

    def shed(running: int) -> str:
        asked.append(running)
        return DROP if running >= 3 else RUN

    async def run() -> None:
        runner = web.AppRunner(web.Application())
        await runner.setup()
        site = tlssite.HandshakeLoggingSite(runner, "127.0.0.1", 0, ssl_context=ctx, handshake_timeout=30, shed=shed)
        await site.start()
        port = site.addresses[0][1]
        try:
            silent = []
            for _ in range(3):  # connected, no ClientHello: three handshakes under way
                silent.append(await asyncio.open_connection("127.0.0.1", port))
                await asyncio.sleep(0.1)
            assert asked == [0, 1, 2] and site.handshakes.n == 3
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"\x16\x03\x01")  # the start of a ClientHello, never read
            try:  # closed at once, unanswered (a reset where the close found those bytes unread)
                assert await asyncio.wait_for(r.read(), 5) == b""
            except ConnectionResetError:
                pass
            assert asked[-1] == 3 and site.handshakes.n == 3
            for _, sw in silent:
                sw.close()
            for _ in range(50):
                if site.handshakes.n == 0:
                    break
                await asyncio.sleep(0.05)
            assert site.handshakes.n == 0  # every one that ended stopped counting
        finally:
            await runner.cleanup()

    asyncio.run(run())


def test_handshakes_under_way_count_at_most_so_many_from_one_address_and_not_for_long():
    """A client holding handshakes open in silence fills at most PER_SOURCE of the count the load
    shedding reads from one address, and none of it after BUSY_FOR seconds: a handshake that computes
    ends in milliseconds; agents, one handshake each from their own address, count whole."""
    now = [100.0]
    running = tlssite.HandshakesRunning(clock=lambda: now[0])
    per = tlssite.HandshakesRunning.PER_SOURCE
    silent = [running.start("10.0.0.9") for _ in range(10 * per)]
    agents = [running.start(f"10.1.0.{i}") for i in range(20)]
    assert running.n == per + 20
    for token in silent[per:]:
        running.done("10.0.0.9", token)
    assert running.n == per + 20  # still PER_SOURCE under way from there
    running.done("10.0.0.9", silent[0])
    assert running.n == per + 19
    now[0] += tlssite.HandshakesRunning.BUSY_FOR / 2
    later = running.start("10.2.0.1")
    assert running.n == per + 20
    now[0] += tlssite.HandshakesRunning.BUSY_FOR / 2 + 0.01
    assert running.n == 1  # only the one begun since counts: the rest are waiting on their peers
    for token in silent[1:per]:
        running.done("10.0.0.9", token)
    for i, token in enumerate(agents):
        running.done(f"10.1.0.{i}", token)
    running.done("10.2.0.1", later)
    assert running.n == 0 and not running._by_source


def test_connections_wait_newest_first_and_none_past_max_wait():
    now = [0.0]
    q = tlssite.HandshakeQueue(clock=lambda: now[0])
    assert q.push("a") == [] and q.push("b") == []
    now[0] = 1.0
    assert q.push("c") == []
    assert q.newest() == "c" and len(q) == 3  # newest first: the oldest are likeliest to have given up
    assert q.take_newest() == "c" and q.newest() == "b"
    now[0] = q.MAX_WAIT + 0.5
    assert q.expired() == ["a", "b"] and len(q) == 0
    q.limit = 2
    assert q.push("d") == [] and q.push("e") == [] and q.push("f") == ["d"]  # pushed out by newer ones


def test_a_connection_beyond_the_cap_waits_unread_and_is_served_when_a_handshake_ends(tmp_path):
    """While the shedding says WAIT, a real TLS client's connection is held, unread, and its handshake
    runs once one under way ends; one that waits past MAX_WAIT is dropped unread and told to ``dropped``."""
    import asyncio

    from aiohttp import web

    from llmgw.tls.ca import init_ca
    from llmgw.tls.context import client_context, server_context
    from llmgw.tls.files import write_pair
    from llmgw.tls.issue import issue_node, issue_server

    ca = init_ca(tmp_path / "ca")
    server = write_pair(tmp_path / "server", *issue_server(ca, ["localhost"], ["127.0.0.1"]))
    ctx = server_context(ca.cert_path, *server)
    client = client_context(ca.cert_path, *write_pair(tmp_path / "node", *issue_node(ca, "node-1")))
    dropped: list[int] = []

    async def run() -> None:
        app = web.Application()
        async def ok(request: web.Request) -> web.Response:
            return web.Response(text="ok")

        app.router.add_get("/", ok)
        runner = web.AppRunner(app)
        await runner.setup()
        site = tlssite.HandshakeLoggingSite(runner, "127.0.0.1", 0, ssl_context=ctx, handshake_timeout=30,
                                            shed=lambda running: WAIT if running >= 1 else RUN,
                                            dropped=lambda: dropped.append(1))
        site.slots.waiting.max_wait = 1.0
        await site.start()
        port = site.addresses[0][1]
        try:
            _, silent = await asyncio.open_connection("127.0.0.1", port)  # a handshake under way, no ClientHello
            await asyncio.sleep(0.1)
            assert site.handshakes.n == 1
            served = asyncio.ensure_future(asyncio.open_connection("127.0.0.1", port, ssl=client,
                                                                   server_hostname="localhost"))
            await asyncio.sleep(0.5)
            assert not served.done() and len(site.slots.waiting) == 1  # held, its ClientHello unread
            silent.close()  # that handshake ends: the one waiting takes its place
            r, w = await asyncio.wait_for(served, 5)
            w.write(b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            assert (await asyncio.wait_for(r.read(), 5)).endswith(b"ok")
            w.close()
            _, silent = await asyncio.open_connection("127.0.0.1", port)
            await asyncio.sleep(0.1)
            late = asyncio.ensure_future(asyncio.open_connection("127.0.0.1", port, ssl=client,
                                                                 server_hostname="localhost"))
            try:  # nobody ends a handshake: after MAX_WAIT it is dropped, never answered
                await asyncio.wait_for(late, 5)
                raise AssertionError("a connection that waited past MAX_WAIT was served")
            except (ConnectionError, ssl.SSLError, OSError):
                pass
            assert dropped == [1] and len(site.slots.waiting) == 0
            silent.close()
        finally:
            await runner.cleanup()

    asyncio.run(run())
