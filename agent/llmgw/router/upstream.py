"""The router's HTTP/1.1 client to engines: one keep-alive pool per endpoint.

Why not aiohttp's client: per request it builds a ClientRequest, a
ClientResponse, header multidicts, a cookie filter, a writer task and a
timer handle, and per upstream read its StreamReader bookkeeping runs in
Python; together that was the largest share of the router's own CPU per
streamed request.  An engine request is always the same shape (a POST with
a JSON body the router already holds), so here it is one ``write`` of head
and body on a pooled connection, and the response is framed by ``http1``.

A response's body is either buffered for ``read`` (before the commit
point, and for non-streaming answers) or, once a stream is committed,
handed synchronously to a sink from the connection's ``data_received``
(``splice.Splice``): no task wakes per read.

Errors: ``ConnectError`` (refused, unreachable, connect timeout),
``Disconnected`` (the connection closed or reset before the response was
complete) and ``http1.ProtocolError`` (malformed response).  Deadlines are
the caller's (``asyncio.timeout_at`` around the attempt); cancelling a
request closes its connection, which aborts the engine's work.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import time
from typing import Any, Protocol
from urllib.parse import urlsplit

from llmgw import compat

from .http1 import CHUNKED, LENGTH, MAX_HEAD, NO_BODY, UNTIL_CLOSE, ChunkedDecoder, Head, ProtocolError, parse_head


class UpstreamError(Exception):
    """The engine connection failed (not a response the engine chose to send)."""


class ConnectError(UpstreamError):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Disconnected(UpstreamError):
    """The connection ended before the response did."""


class Sink(Protocol):
    """Receives a response body as it arrives, from the connection's read callback."""

    def body(self, data: bytes, ended: bool) -> None: ...

    def failed(self, exc: BaseException) -> None: ...


_IDLE, _HEAD, _BODY, _ENDED = 0, 1, 2, 3  # Connection.state


class Connection(asyncio.Protocol):
    """One keep-alive connection to an engine; carries one request at a time."""

    __slots__ = ("pool", "transport", "state", "head", "closed", "idle_since", "_loop", "_buf", "_waiter",
                 "_error", "_sink", "_left", "_chunked", "_reusable", "_framing")

    def __init__(self, pool: "Pool", loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self.state = _IDLE
        self.closed = False
        self.idle_since = 0.0
        self.head: Head | None = None
        self._buf: list[bytes] = []  # undelivered head bytes (_HEAD) or body pieces (_BODY, no sink)
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._sink: Sink | None = None
        self._left = 0
        self._framing = NO_BODY
        self._chunked: ChunkedDecoder | None = None
        self._reusable = False

    # -- asyncio.Protocol ----------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        state = self.state
        if state == _BODY:
            self._body(data)
        elif state == _HEAD:
            self._head_bytes(data)
        else:  # bytes nobody asked for: the connection is out of step, never reuse it
            self._reusable = False
            self.close()

    def eof_received(self) -> bool:
        self.closed = True  # never reused; connection_lost reports the end
        return False

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        state = self.state
        if state == _BODY and self._framing == UNTIL_CLOSE and exc is None:  # the close ends the body
            self._end_body()
        elif state in (_HEAD, _BODY):
            err = Disconnected(f"connection lost: {exc}" if exc else "connection closed by the engine")
            if exc is not None:
                err.__cause__ = exc
            self._fail(err)

    # -- request / response --------------------------------------------------

    def send(self, head: bytes, body: bytes) -> None:
        self.state = _HEAD
        self.head = None
        self._buf = []
        self._error = None
        self._sink = None
        self._reusable = False
        try:
            if len(body) < 65536:
                self.transport.write(head + body)  # one send for the usual small request
            else:
                self.transport.write(head)
                self.transport.write(body)
        except RuntimeError as e:  # the transport closed under us
            raise Disconnected("connection closed before the request was sent") from e

    async def response(self) -> Head:
        """Wait for the response head."""
        while self.head is None and self._error is None:
            await self._wait()
        if self._error is not None:
            raise self._error
        return self.head

    async def read(self) -> bytes:
        """What body bytes arrived (waiting for some if none); b"" once the body ended."""
        while not self._buf and self.state == _BODY and self._error is None:
            await self._wait()
        if self._buf:
            return self._take_buffered()
        if self._error is not None:
            raise self._error
        return b""

    async def read_all(self, limit: int | None = None) -> bytes:
        """The body, or its first ``limit`` bytes (the connection is then not reusable)."""
        parts = []
        size = 0
        while True:
            data = await self.read()
            if not data:
                break
            parts.append(data)
            size += len(data)
            if limit is not None and size >= limit:
                self._reusable = False
                return b"".join(parts)[:limit]
        return b"".join(parts)

    def set_sink(self, sink: Sink | None) -> None:
        """Hand the body to ``sink`` as it arrives (what is buffered first); None to stop."""
        self._sink = sink
        if sink is None:
            return
        if self._buf:
            sink.body(self._take_buffered(), self.state == _ENDED)
        elif self.state == _ENDED:
            sink.body(b"", True)
        if self._error is not None and self._sink is sink:
            sink.failed(self._error)

    def fail(self, exc: BaseException) -> None:
        """Make the pending ``read`` (or the sink) fail with ``exc``: a watchdog's cut."""
        self._reusable = False
        self._fail(exc)

    def pause_reading(self) -> None:
        if not self.closed:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if not self.closed:
            self.transport.resume_reading()

    def release(self) -> None:
        """The caller is done: back to the pool if the response ended cleanly, else closed."""
        self._sink = None
        if self.state == _ENDED and self._reusable and not self.closed and self._error is None:
            self.state = _IDLE
            self.head = None
            self._chunked = None
            self.pool._put(self)
        else:
            self.close()

    def close(self) -> None:
        self._sink = None
        self._reusable = False
        if not self.closed:
            self.closed = True
            self.transport.close()

    def _take_buffered(self) -> bytes:
        buf = self._buf
        self._buf = []
        return buf[0] if len(buf) == 1 else b"".join(buf)

    # -- framing ---------------------------------------------------------------

    def _head_bytes(self, data: bytes) -> None:
        buf = b"".join(self._buf) + data if self._buf else data
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD:
                    self._protocol_error(ProtocolError("response head too long"))
                else:
                    self._buf = [buf]
                return
            try:
                head = parse_head(buf[:end])
            except ProtocolError as e:
                self._protocol_error(e)
                return
            buf = buf[end + 4:]
            if head.status >= 200:
                break
            # 1xx: an interim answer; the real one follows
        self._buf = []
        self.head = head
        self._reusable = head.keep_alive
        self._framing = head.framing
        if head.framing == NO_BODY:
            self.state = _ENDED
            if buf:
                self._reusable = False
        else:
            self.state = _BODY
            self._left = head.length
            self._chunked = ChunkedDecoder() if head.framing == CHUNKED else None
            if buf:
                self._body(buf)
        self._wake()

    def _body(self, data: bytes) -> None:
        framing = self._framing
        ended = False
        if framing == CHUNKED:
            try:
                data, ended = self._chunked.feed(data)
            except ProtocolError as e:
                self._protocol_error(e)
                return
            if ended and self._chunked.extra:
                self._reusable = False
        elif framing == LENGTH:
            left = self._left
            if len(data) >= left:
                if len(data) > left:
                    self._reusable = False
                    data = data[:left]
                ended = True
            self._left = left - len(data)
        if ended:
            self.state = _ENDED
        sink = self._sink
        if sink is not None:
            if data or ended:
                sink.body(data, ended)
            return
        if data:
            self._buf.append(data)
        self._wake()

    def _end_body(self) -> None:
        self.state = _ENDED
        if self._sink is not None:
            self._sink.body(b"", True)
        else:
            self._wake()

    def _protocol_error(self, e: ProtocolError) -> None:
        self._reusable = False
        self._fail(e)
        self.close()

    def _fail(self, exc: BaseException) -> None:
        if self._error is not None:
            return
        self._error = exc
        sink = self._sink
        if sink is not None:
            sink.failed(exc)
        else:
            self._wake()

    async def _wait(self) -> None:
        self._waiter = w = self._loop.create_future()
        try:
            await w
        finally:
            self._waiter = None

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)


class Pool:
    """Keep-alive connections to one endpoint, most recently used first.

    A connection idle for ``keepalive`` seconds or longer is never reused
    (the engine may be closing it) and is closed by ``sweep``.  There is no
    size limit here: the router's per-endpoint concurrency gate bounds it.
    """

    def __init__(self, url: str, connect_timeout: float, keepalive: float, api_key: str | None = None,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.url = url
        # The engine's key rides on every request this pool sends; a client's own
        # Authorization header (its router key) never reaches an engine.
        self.auth = b"Authorization: Bearer %s\r\n" % api_key.encode("ascii") if api_key else b""
        parts = urlsplit(url)
        self.scheme = parts.scheme
        self.host = parts.hostname or ""
        default_port = 443 if parts.scheme == "https" else 80
        self.port = parts.port or default_port
        self.prefix = parts.path.rstrip("/").encode()
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = (host if self.port == default_port else f"{host}:{self.port}").encode("idna")
        self.connect_timeout = connect_timeout
        self.keepalive = keepalive
        self._idle: list[Connection] = []
        # https: verified against ``ssl_context`` (the fleet CA for engines serving TLS with a node's
        # engine certificate), else the system's CAs; the address is checked against the SANs either way
        self._ssl: ssl.SSLContext | None = (
            (ssl_context or ssl.create_default_context()) if parts.scheme == "https" else None)
        self.closed = False

    async def request(self, target: bytes, headers: bytes, body: bytes) -> Connection:
        """Send ``POST target`` with ``headers`` (complete header lines) and ``body``; return the
        connection once the response head arrived.  The caller ``release``s or ``close``s it."""
        conn = await self.send(target, headers, body)
        try:
            await conn.response()
        except BaseException:
            conn.close()
            raise
        return conn

    async def send(self, target: bytes, headers: bytes, body: bytes) -> Connection:
        """Like ``request`` but returns as soon as the request was written: the caller awaits
        ``conn.response()`` and owns the connection from here on (``release`` or ``close``)."""
        conn = self._get()
        if conn is None:
            conn = await self._connect()
        head = (b"POST %s%s HTTP/1.1\r\nHost: %s\r\n%s%sContent-Length: %d\r\n\r\n"
                % (self.prefix, target, self.host_header, self.auth, headers, len(body)))
        try:
            conn.send(head, body)
        except BaseException:
            conn.close()
            raise
        return conn

    def _get(self) -> Connection | None:
        idle = self._idle
        if not idle:
            return None
        oldest = time.monotonic() - self.keepalive
        while idle:
            conn = idle.pop()
            if self._reusable(conn, oldest) and not conn.transport.is_closing():
                return conn
            conn.close()
        return None

    @staticmethod
    def _reusable(conn: Connection, oldest: float) -> bool:
        """Open, and idle for less than ``keepalive`` (``oldest`` = now - keepalive)."""
        return not conn.closed and conn.idle_since > oldest

    def _put(self, conn: Connection) -> None:
        if self.closed:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    async def _connect(self) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            async with compat.timeout(self.connect_timeout):
                transport, conn = await loop.create_connection(
                    lambda: Connection(self, loop), self.host, self.port, ssl=self._ssl,
                    server_hostname=self.host if self._ssl else None)
        except TimeoutError:
            raise ConnectError("connect timeout") from None
        except ssl.SSLError as e:  # the engine's certificate is not the fleet CA's, or not for this address
            verify = getattr(e, "verify_message", None)
            detail = f"certificate verify failed: {verify}" if verify else e.reason or type(e).__name__
            raise ConnectError(f"TLS handshake failed: {detail}") from e
        except OSError as e:  # refused, unreachable, DNS (socket.gaierror), TLS handshake
            reason = os.strerror(e.errno) if isinstance(e.errno, int) and e.errno > 0 else None
            raise ConnectError(reason or e.strerror or type(e).__name__) from e
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        return conn

    def sweep(self) -> None:
        """Close connections idle for ``keepalive`` or longer (and any the engine closed)."""
        oldest = time.monotonic() - self.keepalive
        keep = []
        for conn in self._idle:
            if self._reusable(conn, oldest):
                keep.append(conn)
            else:
                conn.close()
        self._idle = keep

    def close(self) -> None:
        self.closed = True
        for conn in self._idle:
            conn.close()
        self._idle = []


async def request_whole(pool: Pool, target: bytes, headers: bytes, body: bytes, deadline: float) -> tuple[Head, bytes]:
    """One request answered whole by ``deadline`` (the loop's clock): its head and body, the connection
    back in the pool; on any failure (the deadline's ``TimeoutError`` included) the connection is closed
    and the failure raised. For the side requests of disaggregation (a prefill), not the hot path."""
    conn: Connection | None = None
    try:
        async with compat.timeout_at(deadline):
            conn = await pool.request(target, headers, body)
            data = await conn.read_all()
    except BaseException:
        if conn is not None:
            conn.close()
        raise
    assert conn.head is not None
    head = conn.head
    conn.release()
    return head, data
