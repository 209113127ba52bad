"""Forwarding one request: which endpoint each try goes to, and whether another try may follow.

The retry policy: a failed attempt (before the commit point) is retried on
an endpoint not tried yet while the request's total deadline, its
``retries.max_attempts`` and the router-wide retry budget allow; the
deadline is checked first, so a retry that cannot happen spends no budget
token.  When every try failed, the client gets the last failure (an
engine's 429 passed through as it answered).
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from .attempts import Attempts
from .budget import RetryBudget
from .context import RequestContext
from .dualdispatch import DualDispatch, Pair, prefill_unavailable
from .errors import SERVER, RouterError
from .failures import Failed
from .metrics import RouterMetrics
from .prefill import Prefill
from .request import engine_head
from .runtime import ModelGroup, Routing
from .settings import RouterSettings


class Forwarder:
    def __init__(self, settings: RouterSettings, routing: Routing, metrics: RouterMetrics,
                 attempts: Attempts) -> None:
        self.s = settings
        self.routing = routing
        self.metrics = metrics
        self.attempts = attempts
        r = settings.retries
        self.budget = RetryBudget(r.budget_ratio, r.budget_min, r.budget_window)
        self.prefill = Prefill(settings, routing, metrics)
        self.dual = DualDispatch(settings, routing, metrics)

    async def forward(self, request: web.Request, ctx: RequestContext, group: ModelGroup, body: bytes,
                      stream: bool, payload: dict) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        total_deadline = ctx.t0_loop + self.s.timeouts.total
        headers = engine_head(request, stream, ctx.rid)
        target = request.raw_path.encode("utf-8", "surrogateescape")  # path and query as the client sent them
        self.budget.note_request()
        whole = body  # what a retry sends: a decoder that failed may have lost the prefilled blocks
        route_payload = payload if self.routing.prepares is None else await self.routing.prepare(group, payload)
        decoder = None  # a disaggregated model's decoder, chosen before the remote-prefill decision
        if group.prefill is not None and not group.dual:
            decoder, body = await self.prefill.before_decode(ctx, group, target, body, payload, route_payload,
                                                             engine_head(request, False, ctx.rid), total_deadline)
        prefilled: set[str] = set()  # SGLang's pairs: the prefill endpoints this request's tries used
        tried: set[str] = set()
        last: Failed | None = None
        max_attempts = self.s.retries.max_attempts
        while True:
            # the deadline first: a retry that cannot happen spends no retry token
            now = loop.time()
            if now >= total_deadline:
                break
            if decoder is not None and self.routing.usable(decoder, tried):
                pick = decoder  # the prefill, if any, prepared the blocks for it (its prediction noted then)
            else:
                pick = self.routing.pick(group, tried, route_payload)
                if ctx.cache is not None:  # what the index predicted this try's replica holds, read at the pick
                    ctx.cache.predicted = self.routing.predicted(group)
            decoder = None
            if isinstance(pick, RouterError):
                raise pick
            if pick is None:  # a retry with nothing left to try
                break
            if last is not None:
                # A refused or timed-out connect sent nothing: its retry is the request's only
                # load on an engine, so only retries after work was done spend the budget. A failed
                # SGLang prefill left its decoder waiting, not working: trying another prefill costs
                # no more than vLLM's second prefill try, which spends none either.
                if last.outcome not in ("connect", "prefill") and not self.budget.try_acquire():
                    self.metrics.retries_denied.labels(group.model).inc()
                    ctx.note = "retry_budget_exhausted"
                    break
                self.metrics.retries.labels(group.model, last.outcome).inc()
            rt = pick
            pair: Pair | None = None
            if group.dual:  # SGLang: every try is a pair, its prefill sent now beside the decode
                pair = self.dual.start(ctx, group, target, payload, engine_head(request, False, ctx.rid),
                                       total_deadline, route_payload, prefilled)
                if ctx.attempts == 0:
                    self.dual.count(group.model, pair is not None)
                if pair is None:
                    if last is None:
                        raise prefill_unavailable(group.model)
                    break
                body = pair.body
            carried = body is not whole
            if not carried:  # a decoder whose pull failed may take the request again, prefilling it
                tried.add(rt.id)
            ctx.attempts += 1
            ctx.endpoint = rt.id
            rt.outstanding += 1
            try:
                if stream:
                    try_deadline = now + min(self.s.timeouts.per_try, self.s.timeouts.first_token)
                    attempt = self.attempts.stream(request, ctx, rt, group, target, body, headers,
                                                   try_deadline, total_deadline)
                else:
                    attempt = self.attempts.plain(ctx, rt, group, target, body, headers,
                                                  now + self.s.timeouts.per_try, total_deadline)
                result = await (attempt if pair is None else self.dual.run(ctx, attempt, pair))
            finally:
                rt.outstanding -= 1
            if not isinstance(result, Failed):
                return result
            last = result
            body = whole
            if pair is not None and pair.decoder_at_fault:  # its prefill answered: the decoder failed on its own
                tried.add(rt.id)
            if not result.retryable or ctx.attempts >= max_attempts:
                break
        if last is None:  # total deadline passed before any attempt
            raise RouterError(504, "request timed out before it could be sent", SERVER, "timeout",
                              klass="upstream_timeout")
        if last.upstream is not None:
            ctx.status = last.upstream.status
            self.metrics.error(ctx.model_label, last.error.klass)
            return last.upstream
        raise last.error
