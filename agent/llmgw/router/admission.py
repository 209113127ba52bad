"""Per-key and per-source caps on what the router holds for its clients.

A key holder could otherwise pin the router's memory: bodies up to
``limits.max_body_bytes`` are read whole and held while the request is
forwarded, and nothing bounded how many one key or one address held at
once (20 bodies of 15 MiB held one byte short added 463 MiB).  Before a
body is read, its declared size is reserved against the caller's key and
source address (``holdings``); a request over either cap is answered 429
(OpenAI's shape, with ``Retry-After``) without reading a byte of it, and
its connection is closed.  A body that does not arrive at the minimum rate
is cut (408).  The reservation is released when the request ends.

A chunked body has no declared size: it reserves its bytes as they arrive
(reserving ``limits.max_body_bytes`` up front let a few small chunked
requests take a key's whole byte cap), and is cut with the same 429 when
it crosses a cap mid-body, or 413 past ``limits.max_body_bytes``.  Its
deadline grows the same way: it must keep sending at the minimum rate, so
it is cut (408) once it has taken longer than ``body_grace`` plus what it
sent so far at ``body_min_rate``.
Callers the router cannot name (no key, an unknown key: the proxy refuses
them) are held only to the source caps.

Every request refused here is counted as the proxy counts its own answers
(``llmgw_router_requests_total`` with model ``-``, since the body naming
the model was not read) and in ``llmgw_router_errors_total`` under the cap
that refused it (``Refusal.klass``), ``body_timeout`` or ``too_large``.
The path of an admitted request costs what it did before: no allocation,
no await and no clock read for the accounting of refusals.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from aiohttp import web

from llmgw import compat
from llmgw.clientbounds import BodyTooSlow, ClientBounds, ThrottledLog, body_allowance, read_body

from .auth import ANONYMOUS, AuthFailure, KeyRing
from .errors import INVALID_REQUEST, RATE_LIMIT, RouterError
from .holdings import Caps, Held, Holdings, Refusal
from .metrics import RouterMetrics
from .request import PRINCIPAL

__all__ = ["Admission", "Caps", "BODY_CACHE_ATTR"]

log = logging.getLogger("llmgw.router.admission")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# A chunked body is read here, a chunk at a time, so that it is reserved as it arrives; the
# proxy then reads it with ``request.read()``, which returns this (private) attribute of
# aiohttp's request when it is set. tests/unit/test_private_api_guards.py fails, naming it, if
# aiohttp stops doing so (the proxy would read an empty body).
BODY_CACHE_ATTR = "_read_bytes"


class Admission:
    """The caps' bookkeeping; ``wrap`` puts a handler (the proxy's POST paths) behind them."""

    def __init__(self, caps: Caps, bounds: ClientBounds, keys: KeyRing, max_body: int,
                 metrics: RouterMetrics) -> None:
        self.caps = caps
        self.bounds = bounds
        self.keys = keys
        self.max_body = max_body
        self.metrics = metrics
        self.holdings = Holdings(caps)
        self._refused = ThrottledLog(log, "request from %(host)s refused: %(reason)s")
        self._handler: Handler | None = None  # set by ``wrap``

    def wrap(self, handler: Handler) -> Handler:
        """``handler`` behind the caps (a plain wrapper: an aiohttp middleware would run for every path).

        The answer is this object's own ``admit``, bound: no closure, so an
        admitted request pays one coroutine frame for the caps, not two.
        """
        self._handler = handler
        return self.admit

    async def admit(self, request: web.Request) -> web.StreamResponse:
        handler: Handler = self._handler  # type: ignore[assignment]
        try:
            principal = self.keys.authenticate(request.headers.get("Authorization"))
        except AuthFailure:
            return await handler(request)  # refused by the proxy, before it reads the body
        request[PRINCIPAL] = principal
        length = request.content_length
        chunked = False
        if length is None:
            chunked = request.body_exists
            length = 0  # a chunked body reserves its bytes as they arrive
        elif length > self.max_body:
            return await handler(request)  # 413 from the proxy, unread
        key = None if principal is ANONYMOUS else principal.name
        source = request.remote or "-"
        holdings = self.holdings
        refusal = holdings.check(source, key, length)
        if refusal is not None:
            return self._over_cap(source, refusal, 0.0)  # refused at once, before a byte of the body
        held_source = holdings.take(holdings.by_source, source, length)
        held_key = holdings.take(holdings.by_key, key, length) if key is not None else None
        try:
            if chunked:
                return await self._chunked(request, handler, source, held_source, held_key)
            if length and not request.content.is_eof():  # a body already whole needs no deadline
                try:
                    await read_body(request, length, self.bounds)
                except BodyTooSlow as e:
                    return self._too_slow(source, e)
            return await handler(request)
        finally:
            holdings.give(holdings.by_source, source, held_source, length)
            if held_key is not None:
                holdings.give(holdings.by_key, key, held_key, length)  # type: ignore[arg-type]

    async def _chunked(self, request: web.Request, handler: Handler, source: str, held_source: Held,
                       held_key: Held | None) -> web.StreamResponse:
        """A body of no declared size: reserved as it arrives, and what it reserved given back at the end.

        ``got`` grows in the same step as the reservation (no await between), so
        the ``finally`` gives back exactly what was reserved, however this ends.
        Its deadline follows ``got`` (``body_grace`` plus what it sent at
        ``body_min_rate``), as a declared body's follows its size: a deadline
        from ``limits.max_body_bytes`` let ten bytes hold a connection for as long
        as a whole 16 MiB body may take.
        """
        holdings = self.holdings
        limit = self.max_body
        bounds = self.bounds
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        start = loop.time()
        got = 0
        try:
            body = bytearray()
            readany = request.content.readany
            while True:
                # armed for the bytes received so far and re-armed only when it fires: no timer per chunk
                try:
                    async with compat.timeout_at(start + body_allowance(got, bounds)):
                        while chunk := await readany():
                            n = len(chunk)
                            if got + n > limit:
                                return self._refuse(RouterError(
                                    413, f"request body exceeds the limit of {limit} bytes", INVALID_REQUEST,
                                    "request_too_large", klass="too_large"), time.perf_counter() - t0)
                            refusal = holdings.grow(held_source, held_key, n)
                            if refusal is not None:
                                return self._over_cap(source, refusal, time.perf_counter() - t0)
                            got += n
                            body += chunk
                    break
                except TimeoutError:
                    if loop.time() < start + body_allowance(got, bounds):
                        continue  # bytes arrived since the timer was armed: they bought more time
                    if request.content.total_bytes > got:
                        # bytes arrived but are not read yet: the loop was late (a stall past the
                        # deadline sees them and the timer in one iteration), not the client;
                        # a cancelled readany leaves them in the buffer
                        continue
                    return self._too_slow(source, BodyTooSlow(body_allowance(got, bounds), bounds))
            setattr(request, BODY_CACHE_ATTR, bytes(body))
            del body  # not held twice while the request is forwarded
            return await handler(request)
        finally:
            holdings.shrink(held_source, held_key, got)

    def _over_cap(self, source: str, refusal: Refusal, seconds: float) -> web.Response:
        self._refused(source, f"{refusal.who} over its cap of {refusal.reason}")
        return self._refuse(RouterError(
            429, f"too many requests in flight for this {refusal.who} ({refusal.reason}); retry later",
            RATE_LIMIT, "rate_limit_exceeded", klass=refusal.klass, retry_after=self.caps.retry_after), seconds)

    def _too_slow(self, source: str, e: BodyTooSlow) -> web.Response:
        self._refused(source, "request body too slow")
        return self._refuse(RouterError(408, str(e), INVALID_REQUEST, "request_timeout", klass="body_timeout"),
                            e.waited)

    def _refuse(self, err: RouterError, seconds: float) -> web.Response:
        """Count and answer a refusal; the body stays unread: the connection cannot carry another request."""
        self.metrics.refused(err.status, err.klass, seconds)
        resp = err.response()
        resp.force_close()
        return resp
