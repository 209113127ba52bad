"""Refused TLS handshakes: what the log says, and how often."""

from __future__ import annotations

import logging
import ssl

from llmgw.controlplane import tlssite
from llmgw import clientbounds
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

    def shed(running: int) -> bool:
        asked.append(running)
        return running >= 3

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


def test_handshakes_under_way_count_at_most_so_many_from_one_address():
    """A client holding handshakes open in silence from one address fills at most PER_SOURCE of
    the count the load shedding reads; agents, one handshake each from their own address, count whole."""
    running = tlssite.HandshakesRunning()
    per = tlssite.HandshakesRunning.PER_SOURCE
    for _ in range(10 * per):
        running.start("10.0.0.9")
    for i in range(20):
        running.start(f"10.1.0.{i}")
    assert running.n == per + 20
    for _ in range(10 * per - per):
        running.done("10.0.0.9")
    assert running.n == per + 20  # still PER_SOURCE under way from there
    running.done("10.0.0.9")
    assert running.n == per + 19
    for _ in range(per - 1):
        running.done("10.0.0.9")
    for i in range(20):
        running.done(f"10.1.0.{i}")
    assert running.n == 0 and not running._by_source
