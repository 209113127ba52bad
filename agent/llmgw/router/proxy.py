"""The OpenAI data path: authenticate, pick, forward, retry, relay.

Commit point.  Nothing reaches the client before the engine produced its
first token (for streams) or its whole answer (otherwise).  Until then a
failure is invisible and may be retried on another endpoint; after it, a
failure ends the stream with an explicit error event, because resending the
request elsewhere would duplicate tokens the client already has.  vLLM's
first chat chunk carries only the assistant role, so such chunks are held
back with the rest until real output arrives.

Failures that count against an endpoint (outlier ejection): connect
errors, 5xx, timeouts (per try, first token, inter token), streams that
break or end without ``[DONE]``, and in-band error events on a 200 stream.
A 4xx is the client's problem and counts as the engine being alive.

``Proxy`` composes the parts, each with one job: reading the request
(``request``), the retry policy (``forward``), one try up to the commit
point (``attempts``), the committed stream (``relay``, ``watchdog``), what
failures mean (``failures``), the models and paths it serves
(``models``) and the accounting of every answer (``context``).  Here: the
entry points, which turn whatever happened into one OpenAI-shaped answer,
counted once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from aiohttp import web

from .attempts import Attempts
from .auth import KeyRing
from .context import RequestContext, account
from .errors import SERVER, RouterError
from .failures import too_large
from .forward import Forwarder
from .holdqueue import HoldQueue
from .limits import Limiter
from .limitsgate import LimitsGate
from .cachehits import CacheHits
from .metrics import RouterMetrics
from .models import Models
from .relay import Relay, end_stream
from .request import authenticate, parse_body, request_id
from .runtime import Routing
from .settings import RouterSettings

__all__ = ["Proxy"]

log = logging.getLogger("llmgw.router")

Simple = Callable[[web.Request, RequestContext], Awaitable[web.StreamResponse]]


class Proxy:
    def __init__(self, settings: RouterSettings, routing: Routing, metrics: RouterMetrics,
                 pending: Callable[[str], float] | None = None) -> None:
        self.s = settings
        self.routing = routing
        self.metrics = metrics
        self.keys = KeyRing(settings.api_keys, settings.allow_unauthenticated)
        self.models = Models(routing, self.keys, metrics, pending)
        self.attempts = Attempts(routing, Relay(settings, routing, metrics))
        self.forwarder = Forwarder(settings, routing, metrics, self.attempts)
        self.limiter = Limiter(settings.api_keys)
        self.limits_gate = LimitsGate(self.limiter, metrics)
        models = settings.balancing.cache_aware.models
        self.cache_hits = CacheHits(models, metrics) if models else None
        self.holds: HoldQueue | None = None  # scale to sleep: set by build_app

    async def close(self) -> None:
        """Shutdown: stop watching abandoned attempts and SGLang prefills (their connections are closed)."""
        await self.attempts.close()
        await self.forwarder.dual.close()
        self.limits_gate.usage_counts.flush()  # the last second's usage reaches the counters

    # -- entry points -------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        rid = request_id(request)
        ctx = RequestContext(rid, loop.time())
        try:
            resp = await self._handle(request, ctx)
        except RouterError as e:
            ctx.status = e.status
            self.metrics.error(ctx.model_label, e.klass)
            resp = e.response(rid)
            if ctx.limits is None and ctx.key in self.limiter.keys:  # refused before its limits were asked
                ctx.limits = self.limits_gate.unreserved(ctx.key, ctx.model)
        except asyncio.CancelledError:
            # the client went away (handler cancelled); one that left after the whole stream
            # reached it, [DONE] included, was served
            ctx.status = 200 if ctx.delivered else 499
            if ctx.limits is not None:
                self.limits_gate.finish(ctx.limits, ctx.out, ctx.status)
            if ctx.cache is not None:
                self.cache_hits.settle(ctx.cache, ctx.model_label, ctx.out)
            account(ctx, request, self.metrics, self.s.access_log)
            raise
        except Exception:  # noqa: BLE001 - a bug: still an OpenAI-shaped answer, never aiohttp's text 500
            resp = await self._internal_error(ctx)
        if ctx.limits is not None:
            self.limits_gate.finish(ctx.limits, resp, ctx.status or resp.status)
        if ctx.cache is not None:
            self.cache_hits.settle(ctx.cache, ctx.model_label, resp)
        account(ctx, request, self.metrics, self.s.access_log)
        return resp

    async def list_models(self, request: web.Request) -> web.StreamResponse:
        return await self._simple(request, self.models.list_models)

    async def get_model(self, request: web.Request) -> web.StreamResponse:
        return await self._simple(request, self.models.get_model)

    async def fallback(self, request: web.Request) -> web.StreamResponse:
        """Every path and method the app has no route for: 405 on known paths, else 404."""
        return await self._simple(request, self.models.fallback)

    async def _internal_error(self, ctx: RequestContext) -> web.StreamResponse:
        log.exception("rid=%s unexpected error while handling the request", ctx.rid)
        self.metrics.error(ctx.model_label, "internal")
        ctx.note = "internal_error"
        message = f"internal router error (request id {ctx.rid})"
        out = ctx.out
        if out is not None and out.prepared:  # a stream already started: end it with an error event
            await end_stream(out, message, "internal_error")
            return out
        ctx.status = 500
        return RouterError(500, message, SERVER, "internal_error", klass="internal").response(ctx.rid)

    async def _simple(self, request: web.Request, fn: Simple) -> web.StreamResponse:
        """GETs and fallback answers: request id, errors as for POSTs, access log and metrics."""
        loop = asyncio.get_running_loop()
        ctx = RequestContext(request_id(request), loop.time())
        try:
            resp = await fn(request, ctx)
        except RouterError as e:
            self.metrics.error(ctx.model_label, e.klass)
            resp = e.response(ctx.rid)
        except Exception:  # noqa: BLE001
            resp = await self._internal_error(ctx)
        ctx.status = resp.status
        resp.headers["X-Request-Id"] = ctx.rid
        account(ctx, request, self.metrics, self.s.access_log)
        return resp

    async def _handle(self, request: web.Request, ctx: RequestContext) -> web.StreamResponse:
        principal = authenticate(self.keys, request)
        ctx.key = principal.name
        limit = self.s.limits.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise too_large(limit)
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise too_large(limit) from None
        parsed = parse_body(body)
        ctx.model = parsed.model
        self.routing.sync()
        group = self.routing.group(parsed.model)
        # an unknown model and one the key may not use get the same answer: a restricted key
        # must not learn which models exist
        if group is None or not principal.allows(parsed.model):
            raise self.models.unknown_model(parsed.model, principal.allows(parsed.model))
        ctx.model_label = parsed.model
        if group.asleep and self.holds is not None:  # every endpoint asleep: held until one wakes (holdqueue)
            group = await self.holds.admit(parsed.model, group)
        state = self.limiter.keys.get(principal.name) if self.limiter.keys else None
        if state is not None:
            gate = self.limits_gate
            if gate.allowance is None:  # this worker's own windows: no await
                body = gate.reserve(ctx, state, principal.name, parsed, body, request.path)
            else:
                body = await gate.admit(ctx, state, principal.name, parsed, body, request.path)
        if self.cache_hits is not None:
            body = self.cache_hits.admit(ctx, parsed.model, parsed.stream, parsed.payload, body)
        ctx.admitted = time.perf_counter()
        return await self.forwarder.forward(request, ctx, group, body, parsed.stream, parsed.payload)
