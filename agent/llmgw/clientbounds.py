"""Bounds on what one client may hold of a server: connections, time for a head, time for a body.

Shared by the router and the control plane.  Without them a client that
opens connections and never finishes a request head (or sends a body one
byte short and waits) holds a descriptor and a buffer until it chooses to
leave: 2,000 such connections took a control plane with 1,024 descriptors
off the air.

- ``SourceGate`` caps connections per source address; an excess connection
  is aborted as soon as it is accepted, before aiohttp builds anything for it.
- The head deadline is aiohttp's keep-alive timer (``head_timeout_kwargs``):
  aiohttp arms it at accept and after every response and, when it fires,
  closes the connection only if its handler is still waiting for a whole
  request head, which is exactly "a head within N seconds of accept or of
  the previous response".
- ``read_body`` reads a request body at no less than a minimum rate after a
  grace, so a body held one byte short is cut.
- ``ThrottledLog`` writes one line per (peer address, reason) a minute: a
  scanner or a flood of refused requests must not flood the log.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from aiohttp import web

from llmgw import compat

_LOG_EVERY = 60.0  # seconds between two log lines for one peer address and reason


@dataclass(frozen=True)
class ClientBounds:
    """Deadlines and the connection cap common to both listeners (0 disables a cap)."""

    head_timeout: float = 15.0
    body_grace: float = 10.0
    body_min_rate: int = 16384  # bytes a second, after body_grace
    max_connections_per_source: int = 512


def head_timeout_kwargs(bounds: ClientBounds) -> dict[str, Any]:
    """aiohttp server arguments that close a connection without a whole head within ``head_timeout``."""
    return {"keepalive_timeout": bounds.head_timeout}


def peer_host(peer: Any) -> str:
    return peer[0] if isinstance(peer, tuple) and peer else str(peer)


class ThrottledLog:
    """Log ``fmt % {host, port, reason, **extra}`` at most once a minute per (peer address, reason).

    ``port`` is ``":N"`` where the peer is an (address, port) pair, else empty.
    """

    def __init__(self, logger: logging.Logger, fmt: str, every: float = _LOG_EVERY) -> None:
        self._log = logger
        self._fmt = fmt
        self._every = every
        self._last: dict[tuple[str, str], float] = {}

    def __call__(self, peer: Any, reason: str, **extra: Any) -> None:
        host = peer_host(peer)
        now = time.monotonic()
        key = (host, reason)
        if now - self._last.get(key, -self._every) < self._every:
            return
        if len(self._last) > 4096:
            self._last.clear()
        self._last[key] = now
        port = f":{peer[1]}" if isinstance(peer, tuple) and len(peer) > 1 else ""
        self._log.warning(self._fmt, {"host": host, "port": port, "reason": reason, **extra})


class SourceGate:
    """Counts open connections per source address; ``admit`` refuses one over the cap."""

    def __init__(self, cap: int, refused: Callable[[Any, str], None]) -> None:
        self.cap = cap
        self.counts: dict[str, int] = {}
        self._refused = refused

    def admit(self, peer: Any) -> str | None:
        """The source's key when the connection may stay (release it when it closes), else None."""
        host = peer_host(peer)
        n = self.counts.get(host, 0)
        if self.cap and n >= self.cap:
            self._refused(peer, f"more than {self.cap} connections from this address")
            return None
        self.counts[host] = n + 1
        return host

    def release(self, host: str) -> None:
        n = self.counts.get(host, 0) - 1
        if n > 0:
            self.counts[host] = n
        else:
            self.counts.pop(host, None)


class CountedProtocol(asyncio.Protocol):
    """An aiohttp handler behind a ``SourceGate``: refused at ``connection_made``, released at close.

    The handler's data path is bound as this object's own attributes at
    construction (transports look them up once, uvloop's at creation), so
    an admitted connection costs no extra call per read.
    """

    def __init__(self, inner: asyncio.Protocol, gate: SourceGate, source: str | None = None) -> None:
        self._inner = inner
        self._gate = gate
        self._source = source  # already admitted (the control plane admits before the TLS handshake)
        self._open = source is not None
        self.on_lost: Callable[[], None] | None = None
        self.data_received = inner.data_received  # type: ignore[method-assign]
        self.eof_received = inner.eof_received  # type: ignore[method-assign]
        self.pause_writing = inner.pause_writing  # type: ignore[method-assign]
        self.resume_writing = inner.resume_writing  # type: ignore[method-assign]

    @property
    def inner(self) -> asyncio.Protocol:
        return self._inner

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._source is None:
            self._source = self._gate.admit(transport.get_extra_info("peername"))
            if self._source is None:
                transport.abort()  # type: ignore[attr-defined]
                return
            self._open = True
        self._inner.connection_made(transport)

    def vouched(self) -> None:
        """A verified client certificate: the connection stops counting against its source address.

        The cap is for clients that have proved nothing yet. Agents behind one
        NAT address or a TCP load balancer share a source, and each presents a
        certificate of its own: counting them would cap the fleet, not a client.
        """
        if self._open and self._source is not None:
            self._gate.release(self._source)
            self._source = None

    def release(self) -> bool:
        """Give the connection's place back, once; True the first time."""
        if not self._open:
            return False
        self._open = False
        if self._source is not None:
            self._gate.release(self._source)
        if self.on_lost is not None:
            self.on_lost()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        if self.release():
            self._inner.connection_lost(exc)


def gated(factory: Callable[[], asyncio.Protocol], gate: SourceGate) -> Callable[[], asyncio.Protocol]:
    return lambda: CountedProtocol(factory(), gate)


class FactorySite(web.BaseSite):
    """A listening site whose connections get a protocol of our own around the runner's handler.

    aiohttp's sites take no protocol factory, so one is built here from the
    public parts aiohttp's own ``TCPSite``/``SockSite`` are made of
    (``BaseSite.start`` registers the site, ``runner.server`` is the handler
    factory, ``loop.create_server`` listens), with this site's arguments kept
    in its own attributes.  One thing of aiohttp's is relied on: the listener
    is stored in ``BaseSite._server``, which ``BaseSite.stop`` closes and
    ``runner.addresses`` lists (tests/unit/test_private_api_guards.py fails,
    naming it, if aiohttp changes that).
    """

    def __init__(self, runner: web.BaseRunner, listen: dict[str, Any], *, ssl_context: Any = None,
                 backlog: int = 128) -> None:
        super().__init__(runner, ssl_context=ssl_context, backlog=backlog)
        self._owner = runner
        self._listen = listen
        self._tls = ssl_context
        self._queue = backlog
        self._listener: asyncio.AbstractServer | None = None

    def protocol_factory(self, handler: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """What each accepted connection runs, given the runner's handler factory."""
        raise NotImplementedError

    @property
    def addresses(self) -> list[Any]:
        """Where this site listens (``getsockname()`` of each socket); empty before ``start``."""
        return [sock.getsockname() for sock in (self._listener.sockets if self._listener is not None else ())]

    @property
    def name(self) -> str:
        scheme = "https" if self._tls is not None else "http"
        return ", ".join(f"{scheme}://{a[0]}:{a[1]}" for a in self.addresses if isinstance(a, tuple)) \
            or f"{scheme}://(not listening)"

    async def start(self) -> None:
        await super().start()
        handler = self._owner.server
        assert handler is not None
        self._listener = await asyncio.get_running_loop().create_server(self.protocol_factory(handler),
                                                                        backlog=self._queue, **self._listen)
        self._server = self._listener  # what BaseSite.stop closes and runner.addresses lists


def _tls_listen(ssl_context: Any, handshake_timeout: float) -> dict[str, Any]:
    return {"ssl": ssl_context, "ssl_handshake_timeout": handshake_timeout} if ssl_context is not None else {}


class LimitedSockSite(FactorySite):
    """A site on a listening socket with a per-source connection cap and a TLS handshake deadline."""

    def __init__(self, runner: web.BaseRunner, sock: Any, *, gate: SourceGate, handshake_timeout: float,
                 ssl_context: Any = None, backlog: int = 128) -> None:
        super().__init__(runner, {"sock": sock, **_tls_listen(ssl_context, handshake_timeout)},
                         ssl_context=ssl_context, backlog=backlog)
        self._gate = gate

    def protocol_factory(self, handler: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        return gated(handler, self._gate)


class LimitedTCPSite(FactorySite):
    """A TCP site with a per-source connection cap and a TLS handshake deadline."""

    def __init__(self, runner: web.BaseRunner, host: str | None, port: int, *, gate: SourceGate,
                 handshake_timeout: float, ssl_context: Any = None, backlog: int = 128,
                 reuse_address: bool | None = None, reuse_port: bool | None = None) -> None:
        super().__init__(runner, {"host": host, "port": port, "reuse_address": reuse_address,
                                  "reuse_port": reuse_port, **_tls_listen(ssl_context, handshake_timeout)},
                         ssl_context=ssl_context, backlog=backlog)
        self._gate = gate

    def protocol_factory(self, handler: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        return gated(handler, self._gate)


class BodyTooSlow(Exception):
    """The client did not send its body at the minimum rate; ``waited``: the seconds it was given."""

    def __init__(self, allowed: float, bounds: ClientBounds) -> None:
        super().__init__(f"request body not received within {allowed:g}s (at least {bounds.body_min_rate} "
                         f"bytes/s after {bounds.body_grace:g}s)")
        self.waited = allowed


def body_allowance(length: int, bounds: ClientBounds) -> float:
    """Seconds a body of ``length`` bytes may take: ``body_grace``, then at least ``body_min_rate``."""
    return bounds.body_grace + length / bounds.body_min_rate


async def read_body(request: web.BaseRequest, length: int, bounds: ClientBounds) -> bytes:
    """``request.read()`` (cached for later readers) within ``body_grace + length / body_min_rate`` seconds.

    A body already buffered whole is returned without arming a timer: the
    common small request pays nothing.  The deadline is the client's, not
    this loop's: when the loop itself was stalled past it (a long pass, a
    paused process, a starved host), the bytes the client sent meanwhile and
    the expired deadline are seen in the same loop iteration, and a
    cancelling timer would win over them and answer 408 to a client that was
    on time.  So the read runs as its own task, the wait never cancels it,
    and a deadline that fired late by more than ``_STALL_EXCUSED`` is given
    back that lateness (up to ``body_grace``) once more.
    """
    if request.content.is_eof():
        return await request.read()
    loop = asyncio.get_running_loop()
    allowed = body_allowance(length, bounds)
    deadline = loop.time() + allowed
    reader = asyncio.ensure_future(request.read())
    try:
        while True:
            await asyncio.wait((reader,), timeout=max(0.0, deadline - loop.time()))
            if reader.done():
                return reader.result()
            late = loop.time() - deadline
            if late <= _STALL_EXCUSED:
                raise BodyTooSlow(allowed, bounds)
            excused = min(late, bounds.body_grace)
            allowed += excused
            deadline = loop.time() + excused
    finally:
        if not reader.done():
            reader.cancel()


# A deadline that fires this much later than armed means the loop, not the client, was late.
_STALL_EXCUSED = 1.0
