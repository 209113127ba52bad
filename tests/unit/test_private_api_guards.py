"""Every private name of aiohttp, asyncio or multiprocessing the runtime relies on, named here.

Each test fails with the name of what went missing (or stopped working) after
an upgrade, instead of the runtime quietly losing what the name gave it.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import sys
from asyncio import sslproto
from unittest import mock

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from llmgw.clientbounds import LimitedTCPSite, SourceGate
from llmgw.controlplane import tlssite
from llmgw.controlplane.tlssite import TLS_READ_BUFFER, HandshakeLoggingSite
from llmgw.router.admission import BODY_CACHE_ATTR
from llmgw.router.relay import HOLD_HEADERS_ATTR
from llmgw.router.serve import tracker_stop
from llmgw.tls import init_ca, issue_router
from llmgw.tls.files import write_pair

ASYNCIO_DEFAULT_READ = 256 * 1024  # asyncio's SSLProtocol.max_size, 3.11 on
BUFFERED_TLS = sys.version_info >= (3, 11)  # asyncio's TLS protocol with a per-connection read buffer


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    """A server context for 127.0.0.1 and a client context that trusts it."""
    d = tmp_path_factory.mktemp("pki")
    ca = init_ca(d / "ca")
    cert, key = write_pair(d / "site", *issue_router(ca, ["localhost"], ["127.0.0.1"]))
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert, key)
    client = ssl.create_default_context(cafile=str(d / "ca" / "ca.crt"))
    return server, client


async def _read_buffer(request: web.Request) -> web.Response:
    """What asyncio's TLS protocol of this very connection reads at a time (private: tests only)."""
    proto = request.transport._ssl_protocol  # type: ignore[union-attr]
    return web.json_response({"max_size": proto.max_size, "buffer": len(proto._ssl_buffer),
                              "extra_is_dict": isinstance(getattr(proto, "_extra", None), dict),
                              "peercert_kept": "peercert" in getattr(proto, "_extra", {})})


async def _plain(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _runner() -> web.AppRunner:
    app = web.Application()
    app.router.add_get("/", _read_buffer)
    app.router.add_get("/plain", _plain)
    runner = web.AppRunner(app)
    await runner.setup()
    return runner


def test_aiohttp_BaseSite__server_is_the_listener_stop_closes_and_runner_addresses_lists():
    assert "_server" in web.BaseSite.__slots__, "aiohttp.web.BaseSite._server is gone: see llmgw.clientbounds.FactorySite"

    async def scenario():
        runner = await _runner()
        site = LimitedTCPSite(runner, "127.0.0.1", 0, gate=SourceGate(0, lambda *a: None), handshake_timeout=5.0)
        await site.start()
        (address,) = site.addresses
        assert address in runner.addresses, "runner.addresses no longer reads BaseSite._server"
        assert site in runner.sites
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{address[1]}/plain") as r:
            assert await r.text() == "ok"
        await runner.cleanup()
        with pytest.raises(OSError):  # BaseSite.stop closed the listener it found in _server
            socket.create_connection(("127.0.0.1", address[1]), timeout=2).close()

    asyncio.run(scenario())


@pytest.mark.skipif(not BUFFERED_TLS, reason="asyncio's TLS protocol keeps no read buffer before Python 3.11")
def test_asyncio_SSLProtocol_max_size__app_transport_and__start_tls_compatible_are_there():
    from asyncio import selector_events

    assert getattr(sslproto.SSLProtocol, "max_size", None) == ASYNCIO_DEFAULT_READ, \
        "asyncio.sslproto.SSLProtocol.max_size changed: see llmgw.controlplane.tlssite.TLS_READ_BUFFER"
    assert tlssite._SMALL_READS is not None and issubclass(tlssite._SMALL_READS, sslproto.SSLProtocol)
    assert getattr(selector_events._SelectorSocketTransport, "_start_tls_compatible", False), \
        "asyncio's socket transport lost _start_tls_compatible: see llmgw.controlplane.tlssite.start_tls_small_reads"
    # _app_transport is set in __init__: built the way start_tls_small_reads builds it
    loop = asyncio.new_event_loop()
    try:
        proto = tlssite._SMALL_READS(loop, asyncio.Protocol(), ssl.create_default_context(ssl.Purpose.CLIENT_AUTH),
                                     loop.create_future(), True, None, ssl_handshake_timeout=5.0,
                                     call_connection_made=False)
        assert hasattr(proto, "_app_transport"), "asyncio.sslproto.SSLProtocol._app_transport is gone"
        assert len(proto._ssl_buffer) == TLS_READ_BUFFER
    finally:
        loop.close()


@pytest.mark.skipif(not BUFFERED_TLS, reason="asyncio's TLS protocol keeps no read buffer before Python 3.11")
def test_control_plane_site_reads_1_KiB_at_a_time_and_the_routers_tls_on_the_same_loop_keeps_asyncios(tls):
    server_ctx, client_ctx = tls

    async def scenario():
        cp_runner, router_runner = await _runner(), await _runner()
        cp = HandshakeLoggingSite(cp_runner, "127.0.0.1", 0, ssl_context=server_ctx, handshake_timeout=5.0)
        router = LimitedTCPSite(router_runner, "127.0.0.1", 0, ssl_context=server_ctx,
                                gate=SourceGate(0, lambda *a: None), handshake_timeout=5.0)
        await cp.start()
        await router.start()
        seen = {}
        try:
            async with aiohttp.ClientSession() as s:
                for name, site in (("cp", cp), ("router", router)):
                    async with s.get(f"https://127.0.0.1:{site.addresses[0][1]}/", ssl=client_ctx) as r:
                        assert r.status == 200
                        seen[name] = json.loads(await r.text())
        finally:
            await cp_runner.cleanup()
            await router_runner.cleanup()
        return seen

    seen = asyncio.run(scenario())
    assert seen["cp"]["max_size"] == seen["cp"]["buffer"] == TLS_READ_BUFFER
    assert seen["router"]["max_size"] == seen["router"]["buffer"] == ASYNCIO_DEFAULT_READ
    assert sslproto.SSLProtocol.max_size == ASYNCIO_DEFAULT_READ  # asyncio's own class untouched
    # tlssite._drop_peercert_dict reaches the extras through _ssl_protocol._extra
    assert seen["cp"]["extra_is_dict"], "asyncio.sslproto.SSLProtocol._extra is no longer a dict"
    assert not seen["cp"]["peercert_kept"]


def _handshake_across_a_stall(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext) -> str:
    """A client whose TLS handshake starts while the control plane's loop is blocked for longer
    than the handshake deadline (1 s): its ClientHello waits in the socket meanwhile."""
    import threading
    import time

    connected, go = threading.Event(), threading.Event()
    result: dict[str, str] = {}

    async def scenario():
        runner = await _runner()
        site = HandshakeLoggingSite(runner, "127.0.0.1", 0, ssl_context=server_ctx, handshake_timeout=1.0)
        await site.start()
        port = site.addresses[0][1]

        def client() -> None:
            raw = socket.create_connection(("127.0.0.1", port), timeout=20)
            connected.set()
            go.wait(20)
            try:
                with client_ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                    tls.sendall(b"GET /plain HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    result["answer"] = tls.recv(4096).split(b"\r\n", 1)[0].decode()
            except OSError as e:
                result["answer"] = f"{type(e).__name__}: {e}"

        t = threading.Thread(target=client)
        t.start()
        try:
            while not connected.is_set():
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)  # accepted: the handshake (and its deadline) has begun
            go.set()
            time.sleep(2.5)  # the loop stalls past the deadline while the ClientHello arrives
            await asyncio.get_running_loop().run_in_executor(None, t.join, 20)
        finally:
            await runner.cleanup()

    asyncio.run(scenario())
    return result["answer"]


@pytest.mark.skipif(not BUFFERED_TLS, reason="the stall-excusing deadline is SmallReadSSLProtocol's (3.11 on)")
def test_a_control_plane_stall_past_the_handshake_deadline_does_not_abort_the_handshake(tls):
    """Also the guard of the private names the excuse relies on: the deadline handle, its
    callback and the protocol's state (asyncio calls the method by name from a lambda)."""
    assert hasattr(sslproto.SSLProtocol, "_check_handshake_timeout")
    assert sslproto.SSLProtocolState.DO_HANDSHAKE
    server_ctx, client_ctx = tls
    assert _handshake_across_a_stall(server_ctx, client_ctx) == "HTTP/1.1 200 OK"


def test_aiohttp_StreamResponse__send_headers_immediately_holds_the_head_for_the_first_write():
    assert HOLD_HEADERS_ATTR == "_send_headers_immediately"
    assert vars(web.StreamResponse).get(HOLD_HEADERS_ATTR) is True, \
        "aiohttp.web.StreamResponse._send_headers_immediately is gone: see llmgw.router.relay.HOLD_HEADERS_ATTR"

    async def head_sent_at_prepare(hold: bool) -> bool:
        writer = mock.Mock()
        for name in ("write_headers", "write", "write_eof", "drain"):
            setattr(writer, name, mock.AsyncMock())
        resp = web.StreamResponse()
        if hold:
            setattr(resp, HOLD_HEADERS_ATTR, False)
        await resp.prepare(make_mocked_request("GET", "/", writer=writer))
        assert writer.write_headers.await_count == 1
        return writer.send_headers.called

    assert asyncio.run(head_sent_at_prepare(hold=False)), "aiohttp no longer sends the head at prepare()"
    assert not asyncio.run(head_sent_at_prepare(hold=True)), \
        "aiohttp ignores StreamResponse._send_headers_immediately: the head is sent at prepare() regardless"


def test_aiohttp_BaseRequest__read_bytes_is_the_body_read_returns():
    assert BODY_CACHE_ATTR == "_read_bytes"
    # one of aiohttp's own attributes: setting it warns of nothing
    assert BODY_CACHE_ATTR in web.BaseRequest.ATTRS, \
        "aiohttp.web.BaseRequest._read_bytes is gone: see llmgw.router.admission.BODY_CACHE_ATTR"

    async def body_read() -> bytes:
        payload = aiohttp.StreamReader(mock.Mock(_reading_paused=False), 2 ** 16, loop=asyncio.get_running_loop())
        payload.feed_data(b"what the stream still holds")
        payload.feed_eof()
        request = make_mocked_request("POST", "/", payload=payload)
        setattr(request, BODY_CACHE_ATTR, b"the body read before")
        return await request.read()

    assert asyncio.run(body_read()) == b"the body read before", \
        "aiohttp's request.read() ignores BaseRequest._read_bytes: a chunked body would reach the proxy empty"


def test_multiprocessing_resource_tracker__resource_tracker__stop_is_there():
    assert tracker_stop() is not None, \
        "multiprocessing.resource_tracker._resource_tracker._stop is gone: see llmgw.router.serve.tracker_stop"
