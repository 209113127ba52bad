"""An aiohttp site that says why a TLS handshake was refused.

With ``create_server(ssl=...)`` asyncio (and uvloop) run the handshake
inside the transport and drop a failure silently unless the loop is in
debug mode: an agent presenting an expired, self-signed, foreign or
serverAuth-only certificate was simply disconnected, and the control
plane's log said nothing, although that is the first place an operator
looks.  Here each connection is accepted as plain TCP and upgraded with
``loop.start_tls``, so a refused handshake is caught and logged with the
peer and the verifier's reason before the connection is dropped.  Once the
handshake succeeds the aiohttp handler gets the TLS transport exactly as it
would from ``create_server``.

The site also bounds its clients (``llmgw.clientbounds``): connections per
source address are counted at accept, before any handshake, and an excess
one is aborted there; a connection whose client certificate the handshake
verified stops counting (agents behind one NAT address each prove who they
are, and must not cap each other); the handshake has ``head_timeout``; and a connection
that presents no client certificate (an operator with an admin token) is
closed ``anonymous_timeout`` seconds after its handshake unless a request on
it has authenticated by then (``AnonymousDeadline.authenticated``).  A
handshake that times out is told to ``timed_out`` (the control plane counts
it as an agent still arriving: its startup grace holds).  While the control
plane sheds load (``shed``, its admission control), a connection waits at
accept, unread, for a running handshake to end (``HandshakeSlots``), or is
dropped there, before its handshake, which is the dearest part of a connection.

Its connections read ``TLS_READ_BUFFER`` bytes at a time (asyncio's default
is a 256 KiB buffer per connection); the cap is this site's alone, so the
in-process router's TLS, on the same loop, is untouched.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections import deque
from typing import Any, Callable, cast

from aiohttp import web

from llmgw import compat
from llmgw.clientbounds import CountedProtocol, FactorySite, SourceGate, ThrottledLog
from llmgw.controlplane.admission import DROP, RUN, WAIT

log = logging.getLogger("llmgw.controlplane.tls")

HANDSHAKE_TIMEOUT = 30.0


def refusal_reason(exc: BaseException) -> str:
    """What the operator needs from a failed handshake, without OpenSSL's file:line noise."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"client certificate refused: {exc.verify_message or exc.reason}"
    if isinstance(exc, ssl.SSLError):
        return f"TLS handshake failed: {exc.reason or exc}"
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return "TLS handshake timed out"
    return f"TLS handshake failed: {type(exc).__name__}: {exc}"


def _refusal_log() -> ThrottledLog:
    """One line per (peer address, reason) a minute: a scanner must not flood the log."""
    return ThrottledLog(log, "TLS connection from %(host)s%(port)s refused: %(reason)s")


class AnonymousDeadline:
    """Closes connections without a client certificate that have not authenticated in ``timeout`` seconds."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._pending: dict[asyncio.BaseTransport, asyncio.TimerHandle] = {}

    def start(self, transport: asyncio.BaseTransport) -> None:
        loop = asyncio.get_running_loop()
        self._pending[transport] = loop.call_later(self.timeout, self._expire, transport)

    def _expire(self, transport: asyncio.BaseTransport) -> None:
        if self._pending.pop(transport, None) is not None:
            log.debug("closing %s: no client certificate and no admin token within %gs",
                      transport.get_extra_info("peername"), self.timeout)
            transport.abort()  # type: ignore[attr-defined]

    def authenticated(self, transport: asyncio.BaseTransport | None) -> None:
        """A request on ``transport`` proved an admin token: it may stay (or it closed: forget it)."""
        handle = self._pending.pop(transport, None) if transport is not None else None
        if handle is not None:
            handle.cancel()

    def __len__(self) -> int:
        return len(self._pending)


class HandshakesRunning:
    """The TLS handshakes a site is running now, ``n``: what its load shedding weighs a new connection against.

    At most ``PER_SOURCE`` count from any one address, and none after
    ``BUSY_FOR`` seconds.  A handshake waiting for a ClientHello costs no CPU,
    and a client holding many open in silence (within its
    ``max_connections_per_source``, from as many addresses as it has) must not
    fill the count and keep everyone else's connections waiting.  One that is
    computing is done in milliseconds, or in a fraction of a second when
    ``max_tls_handshakes`` share a busy loop.  Agents dial one at a time,
    each from its own address, so a storm of them counts whole.
    """

    PER_SOURCE = 8
    BUSY_FOR = 2.0
    __slots__ = ("_by_source", "_young", "_next", "_clock")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._by_source: dict[str, int] = {}
        self._young: dict[int, float] = {}  # token -> when it began, of those counted: oldest first
        self._next = 0
        self._clock = clock

    @property
    def n(self) -> int:
        young, cutoff = self._young, self._clock() - self.BUSY_FOR
        while young:
            first = next(iter(young))
            if young[first] >= cutoff:
                break
            del young[first]
        return len(young)

    def start(self, source: str) -> int:
        """One began from ``source``; the token to end it with."""
        k = self._by_source.get(source, 0)
        self._by_source[source] = k + 1
        self._next += 1
        if k < self.PER_SOURCE:
            self._young[self._next] = self._clock()
        return self._next

    def done(self, source: str, token: int) -> None:
        k = self._by_source.get(source, 0) - 1
        if k > 0:
            self._by_source[source] = k
        else:
            self._by_source.pop(source, None)
        self._young.pop(token, None)


class HandshakeQueue:
    """Connections accepted while the site's handshakes are capped, unread, waiting for one to end.

    Newest first: under a burst the oldest are the likeliest to have given up
    (an agent's dial, TLS included, times out after 15 s), and a handshake with
    a client that left is the whole cost of a handshake for nothing.  One that
    has waited ``MAX_WAIT`` seconds, or is pushed out by ``LIMIT`` newer ones, is
    dropped, as a shed connection is; its agent backs off and dials again.
    """

    MAX_WAIT = 10.0
    LIMIT = 4096
    __slots__ = ("_waiting", "_clock", "max_wait", "limit")

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_wait: float = MAX_WAIT,
                 limit: int = LIMIT) -> None:
        self._waiting: deque[tuple[float, Any]] = deque()  # (since, connection), oldest first
        self._clock = clock
        self.max_wait, self.limit = max_wait, limit

    def __len__(self) -> int:
        return len(self._waiting)

    def push(self, conn: Any) -> list[Any]:
        """Queue ``conn``; those to drop: pushed out or waited too long."""
        self._waiting.append((self._clock(), conn))
        out = self.expired()
        while len(self._waiting) > self.limit:
            out.append(self._waiting.popleft()[1])
        return out

    def expired(self) -> list[Any]:
        cutoff, out = self._clock() - self.max_wait, []
        while self._waiting and self._waiting[0][0] < cutoff:
            out.append(self._waiting.popleft()[1])
        return out

    def newest(self) -> Any | None:
        """The connection that came last, left on the queue (``take_newest`` takes it); None: none waits."""
        return self._waiting[-1][1] if self._waiting else None

    def take_newest(self) -> Any:
        return self._waiting.pop()[1]


class HandshakeSlots:
    """Who runs a TLS handshake now, who waits (``HandshakeQueue``) and who is dropped, for one site.

    ``verdict(n)`` is the load shedding's word on a connection with ``n``
    handshakes under way (``admission.RUN``/``WAIT``/``DROP``; always RUN
    without one); ``dropped()`` hears of every connection dropped after
    waiting (``verdict`` counts its own DROPs)."""

    __slots__ = ("running", "waiting", "_verdict", "_dropped", "_sweep")

    def __init__(self, verdict: Callable[[int], str] | None = None, dropped: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.running = HandshakesRunning(clock)
        self.waiting = HandshakeQueue(clock)
        self._verdict = verdict
        self._dropped = dropped
        self._sweep: asyncio.TimerHandle | None = None

    def verdict(self) -> str:
        return RUN if self._verdict is None else self._verdict(self.running.n)

    def wait(self, conn: _Upgrade) -> None:
        self._drop_all(self.waiting.push(conn))
        if self._sweep is None:  # one timer for the queue: nothing waits past MAX_WAIT, events or none
            self._sweep = asyncio.get_running_loop().call_later(self.waiting.max_wait / 2, self._swept)

    def _swept(self) -> None:
        self._sweep = None
        self._drop_all(self.waiting.expired())
        if len(self.waiting):
            self._sweep = asyncio.get_running_loop().call_later(self.waiting.max_wait / 2, self._swept)

    def ended(self) -> None:
        """A handshake ended: the newest connection waiting takes its place, if the shedding lets it."""
        self._drop_all(self.waiting.expired())
        while (conn := self.waiting.newest()) is not None:
            if conn.closing:
                self.waiting.take_newest()
                continue
            verdict = self.verdict()
            if verdict == WAIT:
                return  # it stays where it is, as old as it was
            self.waiting.take_newest()
            if verdict == RUN:
                conn.begin()
                return
            conn.drop()  # counted by the verdict

    def _drop_all(self, conns: list[_Upgrade]) -> None:
        for conn in conns:
            conn.drop()
            if self._dropped is not None:
                self._dropped()


class _Upgrade(asyncio.Protocol):
    """Holds an accepted TCP connection until its TLS handshake succeeds or fails."""

    __slots__ = ("_factory", "_ctx", "_refused", "_gate", "_anonymous", "_handshake_timeout", "_timed_out",
                 "_slots", "_source", "_app", "_transport", "_task")

    def __init__(self, factory: Callable[[], asyncio.Protocol], ctx: ssl.SSLContext,
                 refused: Callable[[Any, str], None], gate: SourceGate, anonymous: AnonymousDeadline,
                 handshake_timeout: float, timed_out: Callable[[], None] | None = None,
                 *, slots: HandshakeSlots) -> None:
        self._factory = factory
        self._ctx = ctx
        self._refused = refused
        self._gate = gate
        self._anonymous = anonymous
        self._handshake_timeout = handshake_timeout
        self._timed_out = timed_out
        self._slots = slots  # the site's, shared by all its connections
        self._source: str | None = None
        self._app: CountedProtocol | None = None
        self._transport: asyncio.Transport | None = None
        self._task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)
        source = self._source = self._gate.admit(transport.get_extra_info("peername"))
        if source is None:  # over the cap: nothing read, no handshake, the descriptor freed now
            transport.abort()
            return
        verdict = self._slots.verdict()
        if verdict == DROP:  # nothing read, no handshake: the peer backs off
            self._gate.release(source)
            transport.abort()
            return
        compat.pause_reading_at_accept(transport)  # the ClientHello waits in the socket for start_tls
        self._transport = transport
        if verdict == WAIT:
            self._slots.wait(self)
        else:
            self.begin()

    @property
    def closing(self) -> bool:
        return self._transport is None or self._transport.is_closing()

    def begin(self) -> None:
        """Run the handshake (the ClientHello still waits unread in the socket)."""
        transport, source = self._transport, self._source
        assert transport is not None and source is not None
        self._app = CountedProtocol(self._factory(), self._gate, source)
        self._task = asyncio.get_running_loop().create_task(self._handshake(transport))
        slots = self._slots
        token = slots.running.start(source)

        def ended(_task: asyncio.Task[None]) -> None:  # however it ends, cancelled before it began included
            slots.running.done(source, token)
            slots.ended()

        self._task.add_done_callback(ended)

    def drop(self) -> None:
        """Waited too long, or pushed out: nothing read, no handshake; the peer backs off."""
        transport, self._transport = self._transport, None
        if transport is not None and self._task is None:
            assert self._source is not None
            self._gate.release(self._source)
            transport.abort()

    async def _handshake(self, transport: asyncio.Transport) -> None:
        loop = asyncio.get_running_loop()
        app = self._app
        assert app is not None
        began = loop.time()
        try:
            tls = await start_tls_small_reads(loop, transport, app, self._ctx, self._handshake_timeout)
        except ssl.SSLError as e:
            app.release()
            self._refused(transport.get_extra_info("peername"), refusal_reason(e))
            transport.abort()
            return
        except (OSError, TimeoutError, asyncio.TimeoutError) as e:
            # the peer hung up or stalled mid-handshake (port scans, load-balancer checks)
            app.release()
            log.debug("TLS handshake with %s abandoned: %s", transport.get_extra_info("peername"), e)
            transport.abort()
            # A timeout (asyncio's is a ConnectionAbortedError once handshake_timeout has passed), not
            # a peer that hung up: a TCP health check closes at once, while a client whose hello this
            # process was too busy to answer in time will dial again.
            if self._timed_out is not None and (isinstance(e, (TimeoutError, asyncio.TimeoutError))
                                                or loop.time() - began >= self._handshake_timeout):
                self._timed_out()
            return
        except BaseException:
            app.release()
            raise
        if tls is None:  # the connection closed as the handshake ended
            app.release()
            transport.abort()
            return
        _drop_peercert_dict(tls)
        ssl_object = tls.get_extra_info("ssl_object")
        certified = ssl_object is not None and ssl_object.getpeercert(binary_form=True) is not None
        if not certified:
            self._anonymous.start(tls)
            app.on_lost = lambda: self._anonymous.authenticated(tls)
        app.connection_made(tls)
        if certified:  # the CA vouched for it: a node, router or operator, known by identity, not address
            app.vouched()

    def connection_lost(self, exc: Exception | None) -> None:
        # only before start_tls took the transport over: the peer left before the handshake began
        if self._task is None and self._transport is not None:  # closed while it waited (not by drop)
            self._transport = None
            assert self._source is not None
            self._gate.release(self._source)
        elif self._task is not None and not self._task.done():
            self._task.cancel()
            if self._app is not None:
                self._app.release()


# asyncio's TLS protocol (3.11+) allocates and zero-fills a read buffer of
# SSLProtocol.max_size bytes for every connection: 256 KiB, a quarter of a
# megabyte per agent stream before it sends a byte, 2.5 GB for 10,000 nodes.
# This site's connections read at most this much at a time instead. What an
# agent sends is a few hundred bytes a heartbeat and about 20 KB once, at
# register. Measured with 2,000 mutual-TLS connections on loopback, each
# sending 20 KB: 34.9 KiB resident per connection with 1 KiB reads against
# 41.9 KiB with 4 KiB reads (38.1 and 34.9 idle), for 0.1 ms more CPU per 20 KB
# received. Only this site's: the in-process router's TLS listener (proxied
# request bodies, megabytes) keeps asyncio's buffer.
TLS_READ_BUFFER = 1024


# A handshake deadline that fires this late fired while the loop was away, not
# while the peer was: what the peer sent meanwhile waits unread in the socket.
HANDSHAKE_STALL_EXCUSED = 1.0


def _small_read_protocol() -> type | None:
    """asyncio's TLS protocol with ``max_size`` of ``TLS_READ_BUFFER``, or None where there is nothing to cap.

    Python 3.10's TLS protocol has no per-connection read buffer; uvloop's is
    its own.  A subclass, not asyncio's class changed: the cap is this site's
    alone.

    Its handshake deadline also does not count the control plane's own stalls
    against the peer.  asyncio runs the I/O a stalled loop finds waiting before
    the timers that came due meanwhile, so after a pause longer than the
    deadline it read a ClientHello, answered it and then aborted the
    connection at once, before the client could reply: every handshake in
    flight was lost to a pause the clients had no part in (seen: a 15.8 s stall
    against a 15 s deadline).  A deadline that fires more than
    ``HANDSHAKE_STALL_EXCUSED`` late is moved on by the lateness (at most one
    more deadline), so the peer gets back the time the loop was away."""
    from asyncio import sslproto

    base = getattr(sslproto, "SSLProtocol", None)
    if base is None or not issubclass(base, asyncio.BufferedProtocol) or \
            getattr(base, "max_size", 0) <= TLS_READ_BUFFER:
        return None

    def _check_handshake_timeout(self: Any) -> None:
        handle = self._handshake_timeout_handle
        late = 0.0 if handle is None else self._loop.time() - handle.when()
        if late > HANDSHAKE_STALL_EXCUSED and self._state is sslproto.SSLProtocolState.DO_HANDSHAKE:
            self._handshake_timeout_handle = self._loop.call_later(
                min(late, self._ssl_handshake_timeout), self._check_handshake_timeout)
            return
        base._check_handshake_timeout(self)

    return type("SmallReadSSLProtocol", (base,), {"max_size": TLS_READ_BUFFER, "__slots__": (),
                                                 "_check_handshake_timeout": _check_handshake_timeout})


_SMALL_READS = _small_read_protocol()


async def start_tls_small_reads(loop: asyncio.AbstractEventLoop, transport: asyncio.Transport,
                                protocol: asyncio.BaseProtocol, ctx: ssl.SSLContext,
                                handshake_timeout: float) -> asyncio.Transport | None:
    """``loop.start_tls(server_side=True)`` whose connection reads ``TLS_READ_BUFFER`` bytes at a time.

    asyncio builds its TLS protocol inside ``start_tls`` with no way to pass
    a buffer size, so on asyncio's own loop (3.11+) the same steps are taken
    here with ``SmallReadSSLProtocol``: the protocol is made, the transport
    handed to it, and its TLS transport returned once the handshake is done.
    Elsewhere (uvloop, 3.10) it is ``loop.start_tls``.  What this relies on
    (``asyncio.sslproto.SSLProtocol``, its ``max_size``, ``_app_transport`` and
    handshake deadline (``_check_handshake_timeout``, ``_handshake_timeout_handle``,
    ``_state``), the transport's ``_start_tls_compatible``) is named by
    tests/unit/test_private_api_guards.py, which fails if any goes."""
    cls = _SMALL_READS
    if cls is None or not isinstance(loop, asyncio.BaseEventLoop) or \
            not getattr(transport, "_start_tls_compatible", False):
        return await loop.start_tls(transport, protocol, ctx, server_side=True,
                                    ssl_handshake_timeout=handshake_timeout)
    waiter = loop.create_future()
    tls = cls(loop, protocol, ctx, waiter, True, None, ssl_handshake_timeout=handshake_timeout,
              call_connection_made=False)
    transport.pause_reading()  # as start_tls: nothing reaches the protocol before connection_made
    transport.set_protocol(tls)
    made = loop.call_soon(tls.connection_made, transport)
    resumed = loop.call_soon(transport.resume_reading)
    try:
        await waiter
    except BaseException:
        transport.close()
        made.cancel()
        resumed.cancel()
        raise
    return tls._app_transport


def _drop_peercert_dict(tls: asyncio.BaseTransport) -> None:
    """Forget the ``getpeercert()`` dict asyncio files under the transport's ``peercert`` extra at handshake.

    It is about 2 KB held for the life of every connection (20 MB at 10,000
    agents), and nothing here reads it: identities are parsed from the DER
    certificate (``llmgw.tls.identity``), which ``ssl_object`` still gives.
    A no-op where asyncio keeps its extras elsewhere."""
    extra = getattr(getattr(tls, "_ssl_protocol", None), "_extra", None)
    if isinstance(extra, dict):
        extra.pop("peercert", None)


class HandshakeLoggingSite(FactorySite):
    """A TCP site whose TLS handshakes are run, and their refusals logged, by ``_Upgrade``."""

    def __init__(self, runner: web.BaseRunner, host: str | None, port: int, *, ssl_context: ssl.SSLContext,
                 gate: SourceGate | None = None, anonymous: AnonymousDeadline | None = None,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT, backlog: int = 128,
                 reuse_address: bool | None = None, reuse_port: bool | None = None,
                 timed_out: Callable[[], None] | None = None, shed: Callable[[int], str] | None = None,
                 dropped: Callable[[], None] | None = None) -> None:
        # plain TCP at accept: the handshake is _Upgrade's
        super().__init__(runner, {"host": host, "port": port, "reuse_address": reuse_address,
                                  "reuse_port": reuse_port}, ssl_context=ssl_context, backlog=backlog)
        self._ctx = ssl_context
        self._refused = _refusal_log()
        self._gate = SourceGate(0, self._refused) if gate is None else gate
        self._anonymous = AnonymousDeadline(HANDSHAKE_TIMEOUT) if anonymous is None else anonymous
        self._handshake_timeout = handshake_timeout
        self._timed_out = timed_out
        # (handshakes running) RUN, WAIT or DROP the connection just accepted (admission's load shedding)
        self.slots = HandshakeSlots(shed, dropped)

    @property
    def handshakes(self) -> HandshakesRunning:
        return self.slots.running

    def protocol_factory(self, handler: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        return lambda: _Upgrade(handler, self._ctx, self._refused, self._gate, self._anonymous,
                                self._handshake_timeout, self._timed_out, slots=self.slots)
