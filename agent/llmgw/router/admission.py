"""Per-key and per-source caps on what the router holds for its clients.

A key holder could otherwise pin the router's memory: bodies up to
``limits.max_body_bytes`` are read whole and held while the request is
forwarded, and nothing bounded how many one key or one address held at
once (20 bodies of 15 MiB held one byte short added 463 MiB).  Before a
body is read, its declared size is reserved against the caller's key and
source address; a request over either cap is answered 429 (OpenAI's
shape, with ``Retry-After``) without reading a byte of it, and its
connection is closed.  A body that does not arrive at the minimum rate is
cut (408).  The reservation is released when the request ends.

A chunked body has no declared size: it reserves ``limits.max_body_bytes``.
Callers the router cannot name (no key, an unknown key: the proxy refuses
them) are held only to the source caps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Awaitable, Callable

from aiohttp import web

from llmgw.clientbounds import BodyTooSlow, ClientBounds, ThrottledLog, read_body

from .auth import ANONYMOUS, AuthFailure, KeyRing
from .errors import INVALID_REQUEST, RATE_LIMIT, RouterError

log = logging.getLogger("llmgw.router.admission")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Caps:
    """0 disables a cap."""

    requests_per_key: int = 512
    requests_per_source: int = 1024
    body_bytes_per_key: int = 64 * 1024 * 1024
    body_bytes_per_source: int = 64 * 1024 * 1024
    retry_after: int = 1


class _Held:
    """What one key or source holds now: requests and reserved body bytes."""

    __slots__ = ("requests", "bytes")

    def __init__(self) -> None:
        self.requests = 0
        self.bytes = 0


class Admission:
    """The caps' bookkeeping; ``wrap`` puts a handler (the proxy's POST paths) behind them."""

    def __init__(self, caps: Caps, bounds: ClientBounds, keys: KeyRing, max_body: int) -> None:
        self.caps = caps
        self.bounds = bounds
        self.keys = keys
        self.max_body = max_body
        self.by_key: dict[str, _Held] = {}
        self.by_source: dict[str, _Held] = {}
        self._refused = ThrottledLog(log, "request from %(host)s refused: %(reason)s")

    def _over(self, held: _Held | None, n: int, cap_requests: int, cap_bytes: int) -> str | None:
        if held is None:
            return None
        if cap_requests and held.requests + 1 > cap_requests:
            return f"{cap_requests} requests in flight"
        if cap_bytes and n and held.bytes + n > cap_bytes:
            return f"{cap_bytes} bytes of request bodies in flight"
        return None

    def _take(self, table: dict[str, _Held], name: str, n: int) -> _Held:
        held = table.get(name)
        if held is None:
            held = table[name] = _Held()
        held.requests += 1
        held.bytes += n
        return held

    @staticmethod
    def _give(table: dict[str, _Held], name: str, held: _Held, n: int) -> None:
        held.requests -= 1
        held.bytes -= n
        if held.requests <= 0:
            table.pop(name, None)

    def wrap(self, handler: Handler) -> Handler:
        """``handler`` behind the caps (a plain wrapper: an aiohttp middleware would run for every path)."""
        async def admitted(request: web.Request) -> web.StreamResponse:
            return await self.admit(request, handler)
        return admitted

    async def admit(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            principal = self.keys.authenticate(request.headers.get("Authorization"))
        except AuthFailure:
            return await handler(request)  # refused by the proxy, before it reads the body
        length = request.content_length
        if length is None:
            length = self.max_body if request.body_exists else 0
        elif length > self.max_body:
            return await handler(request)  # 413 from the proxy, unread
        caps = self.caps
        key = None if principal is ANONYMOUS else principal.name
        source = request.remote or "-"
        why = self._over(self.by_source.get(source), length, caps.requests_per_source, caps.body_bytes_per_source)
        who = "source"
        if why is None and key is not None:
            why = self._over(self.by_key.get(key), length, caps.requests_per_key, caps.body_bytes_per_key)
            who = "key"
        if why is not None:
            self._refused(source, f"{who} over its cap of {why}")
            resp = RouterError(429, f"too many requests in flight for this {who} ({why}); retry later",
                               RATE_LIMIT, "rate_limit_exceeded", klass="saturated",
                               retry_after=caps.retry_after).response()
            resp.force_close()  # the body stays unread: the connection cannot carry another request
            return resp
        held_source = self._take(self.by_source, source, length)
        held_key = self._take(self.by_key, key, length) if key is not None else None
        try:
            if length:
                try:
                    await read_body(request, length, self.bounds)
                except BodyTooSlow as e:
                    self._refused(source, "request body too slow")
                    resp = RouterError(408, str(e), INVALID_REQUEST, "request_timeout",
                                       klass="bad_request").response()
                    resp.force_close()
                    return resp
                except web.HTTPRequestEntityTooLarge:  # a chunked body past the limit
                    resp = RouterError(413, f"request body exceeds the limit of {self.max_body} bytes",
                                       INVALID_REQUEST, "request_too_large",
                                       klass="too_large").response()
                    resp.force_close()
                    return resp
            return await handler(request)
        finally:
            self._give(self.by_source, source, held_source, length)
            if held_key is not None:
                self._give(self.by_key, key, held_key, length)  # type: ignore[arg-type]
