"""Per-key limits on the request path: admit or refuse (429), then settle when the request ends.

The proxy calls ``admit`` once the body is parsed and the model allowed,
only for a key with a ``limits`` block (one dict lookup decides it: a key
without limits pays nothing more), and ``finish`` when the answer is
complete, whatever ended it: a whole answer, a stream relayed to its end,
an upstream error, or a client that went away (the handler is cancelled).

Estimates, stated once: a request's prompt is ``ceil(body bytes / 4)``
tokens (about four bytes a token for English text in JSON; the engine's
``usage`` replaces it at settlement), its completion ``max_tokens`` (or
``max_completion_tokens``) times ``n``, else the key's
``default_max_tokens``; an embeddings request reserves no completion.
Settlement charges the engine's ``usage`` when the answer carried one; an
error answer without usage charges no tokens (the request still counts);
a stream that ended without usage charges the prompt estimate and one
completion token per event relayed (``usage.StreamMeter``).

Every answer to a limited key carries OpenAI's rate-limit headers
(``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``, the tightest
window of each kind, as of admission); a refusal adds ``Retry-After``
(whole seconds, rounded up) and ``retry-after-ms``, which the official
clients read before ``Retry-After``.

With ``allowance`` (a router fed by a control plane, ``allowance.mode:
shared``) the window limits are spent from slices leased from the control
plane (``allowance.py``) instead of this worker's own windows, and
concurrent requests hold slots leased the same way; a request
that finds its slices short waits for one exchange, and when the control
plane does not answer ``allowance.on_outage`` decides: ``serve`` spends
the slices held past their lease, then this worker's own windows;
``refuse`` answers 429.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from .context import RequestContext
from .errors import INVALID_REQUEST, RATE_LIMIT, RouterError
from .allowance import Allowance, Short, Unavailable
from .limits import KeyState, Limiter, RateView, Refused, Ticket
from .metrics import RouterMetrics
from .request import ParsedRequest
from .usage import StreamMeter, Usage, body_usage
from .usagelog import UsageLog

__all__ = ["LimitsGate", "Limited", "UsageCounters", "reset_text", "with_include_usage", "BYTES_PER_TOKEN"]

BYTES_PER_TOKEN = 4


@dataclass(slots=True)
class Limited:
    """What the request path keeps of a limited key's request (``RequestContext.limits``); one per request."""

    headers: dict[str, str]
    ticket: Ticket | None = None
    meter: StreamMeter | None = None


class LimitsGate:
    def __init__(self, limiter: Limiter, metrics: RouterMetrics) -> None:
        self.limiter = limiter
        self.metrics = metrics
        self.allowance: Allowance | None = None  # set by the worker when limits are shared
        self.usage_log: UsageLog | None = None  # set by a standalone worker with usage_log (router/usagelog.py)
        self.usage_counts = UsageCounters(metrics)

    def reserve(self, ctx: RequestContext, state: KeyState, key: str, parsed: ParsedRequest, body: bytes,
                path: str) -> bytes:
        """``admit`` on this worker's own windows (no ``allowance``): nothing to wait for, so no coroutine.

        The proxy calls this one directly: a one-token request is short enough that a
        coroutine frame created and finished per request showed in its CPU.
        """
        prompt, completion = _estimate(state, parsed, body, path)
        got = self.limiter.admit(state, key, parsed.model, prompt, completion, asyncio.get_running_loop().time())
        return self._admitted(ctx, got, key, parsed, body)

    async def admit(self, ctx: RequestContext, state: KeyState, key: str, parsed: ParsedRequest, body: bytes,
              path: str) -> bytes:
        """Reserve for this request (``ctx.limits``) and return the body to send, or raise the refusal.

        A stream whose client did not ask for ``include_usage`` is sent with it
        (``with_include_usage``), and the usage event is cut from what the
        client receives.
        """
        if self.allowance is None:
            return self.reserve(ctx, state, key, parsed, body, path)
        prompt, completion = _estimate(state, parsed, body, path)
        got = await self._shared(self.allowance, state, key, parsed.model, prompt, completion)
        return self._admitted(ctx, got, key, parsed, body)

    def _admitted(self, ctx: RequestContext, got: Ticket | Refused, key: str, parsed: ParsedRequest,
                  body: bytes) -> bytes:
        headers = _headers(got.requests, got.tokens)
        if isinstance(got, Refused):
            ctx.limits = Limited(headers)
            self.metrics.key_refusals.labels(key, ctx.model_label, got.dimension).inc()
            raise refusal(got, headers)
        ctx.limits = lim = Limited(headers, got)
        if parsed.stream:
            opts = parsed.payload.get("stream_options")
            asked = isinstance(opts, dict) and opts.get("include_usage") is True
            lim.meter = StreamMeter(strip=not asked)
            if not asked:
                body = with_include_usage(body, parsed.payload)
                # a body rebuilt from the payload (a disaggregated model's decode request) asks too
                parsed.payload["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
        return body

    async def _shared(self, al: Allowance, state: KeyState, key: str, model: str, prompt: int,
                      completion: int) -> Ticket | Refused:
        """Admission on leased slices: at most two exchanges (another request may take what one brought)."""
        got = al.take(state, key, model, prompt, completion, al.clock())
        for _ in range(2):
            if not isinstance(got, Short):
                return got
            try:
                await al.fetch(got)
            except Unavailable as e:
                now = al.clock()
                if al.on_outage == "serve":
                    got = al.take(state, key, model, prompt, completion, now, stale_ok=True)
                    if isinstance(got, Short):
                        got = self.limiter.admit(state, key, model, prompt, completion, now)
                    return got
                limit = next(iter(got.asks.values()))[0]
                return Refused("allowance_unavailable", max(1.0, e.retry_after), limit,
                               *al.views(state, key, model, now))
            got = al.take(state, key, model, prompt, completion, al.clock())
        if isinstance(got, Short):  # other requests of this worker took each slice fetched for us
            limit = next(iter(got.asks.values()))[0]
            return Refused("allowance_contended", 1.0, limit, *al.views(state, key, model, al.clock()))
        return got

    def unreserved(self, key: str, model: str | None) -> Limited:
        """The headers of a limited key's answer refused before admission (a bad body, an unknown model)."""
        state = self.limiter.keys[key]
        if self.allowance is not None:
            req, tok = self.allowance.views(state, key, model or "", self.allowance.clock())
        else:
            req, tok = self.limiter.views(state, model or "", asyncio.get_running_loop().time())
        return Limited(_headers(req, tok))

    def finish(self, lim: Limited, resp: web.StreamResponse | None, status: int) -> None:
        """Settle the request's reservation and put the rate-limit headers on an answer not yet sent."""
        if resp is not None and not resp.prepared:
            resp.headers.update(lim.headers)
        ticket = lim.ticket
        if ticket is None or ticket.settled:
            return
        used = self._used(lim, resp, status)
        cached = min(used.cached or 0, used.prompt)  # part of the prompt, never more than it
        self.limiter.settle(ticket, used.prompt, used.completion, asyncio.get_running_loop().time(), cached)
        self.usage_counts.add(ticket.key, ticket.model, used.prompt, used.completion, cached)
        if self.usage_log is not None:
            self.usage_log.add(ticket.key, ticket.model, used.prompt, used.completion, cached)

    def _used(self, lim: Limited, resp: web.StreamResponse | None, status: int) -> Usage:
        ticket = lim.ticket
        assert ticket is not None
        if lim.meter is not None and (lim.meter.usage is not None or lim.meter.events):
            return lim.meter.charged(ticket.prompt)
        if isinstance(resp, web.Response) and isinstance(resp.body, bytes):
            u = body_usage(resp.body)
            if u is not None:
                return u
        if status >= 400 and status != 499:
            return Usage(0, 0)  # refused or failed before any generation the router saw
        return Usage(ticket.prompt, 0)  # the client left before output: the prompt was sent


class UsageCounters:
    """A limited key's usage counters, summed per key and model and added at most once a second.

    Each ``Counter.inc`` takes a lock (and with several workers writes a shared
    file); three or four per request were a visible part of what limits cost a
    one-token request.  Sums wait here instead and reach the counters in one
    batch a second after the first of them (a timer, so an idle router still
    adds the last ones): a scrape lags by at most a second, nothing is lost.
    """

    FLUSH_AFTER = 1.0

    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics
        self._sums: dict[tuple[str, str], list[int]] = {}  # requests, prompt, completion, cached
        self._children: dict[tuple[str, str], tuple] = {}  # label children, resolved once (labels() locks)
        self._timer: asyncio.TimerHandle | None = None

    def add(self, key: str, model: str, prompt: int, completion: int, cached: int) -> None:
        s = self._sums.get((key, model))
        if s is None:
            s = self._sums[(key, model)] = [0, 0, 0, 0]
        s[0] += 1
        s[1] += prompt
        s[2] += completion
        s[3] += cached
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.FLUSH_AFTER, self.flush)

    def flush(self) -> None:
        """Add every sum to its counters (also at shutdown, so none is lost)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        sums, self._sums = self._sums, {}
        m = self.metrics
        for (key, model), s in sums.items():
            c = self._children.get((key, model))
            if c is None:
                c = self._children[(key, model)] = (
                    m.key_requests.labels(key, model), m.key_prompt_tokens.labels(key, model),
                    m.key_completion_tokens.labels(key, model), m.key_cached_prompt_tokens.labels(key, model))
            for child, amount in zip(c, s):
                if amount:
                    child.inc(amount)


def refusal(got: Refused, headers: dict[str, str]) -> RouterError:
    if math.isinf(got.retry_after):
        return RouterError(
            400, f"request too large for this key's {got.dimension} limit of {got.limit}: lower max_tokens or "
            "shorten the prompt", INVALID_REQUEST, "request_too_large_for_limit", klass="key_limit")
    headers["retry-after-ms"] = str(max(1, math.ceil(got.retry_after * 1000)))
    return RouterError(
        429, f"rate limit reached for this key ({got.dimension}: limit {got.limit}); retry in "
        f"{reset_text(got.retry_after)}", RATE_LIMIT, "rate_limit_exceeded", klass="key_limit",
        retry_after=max(1, math.ceil(got.retry_after)))


def _headers(req: RateView | None, tok: RateView | None) -> dict[str, str]:
    h: dict[str, str] = {}
    if req is not None:
        h["x-ratelimit-limit-requests"] = str(req[0])
        h["x-ratelimit-remaining-requests"] = str(req[1])
        h["x-ratelimit-reset-requests"] = reset_text(req[2])
    if tok is not None:
        h["x-ratelimit-limit-tokens"] = str(tok[0])
        h["x-ratelimit-remaining-tokens"] = str(tok[1])
        h["x-ratelimit-reset-tokens"] = reset_text(tok[2])
    return h


_INCLUDE_USAGE = b'"stream_options":{"include_usage":true},'


def with_include_usage(body: bytes, payload: dict[str, Any]) -> bytes:
    """``body`` asking the engine for the stream's usage event.

    Without ``stream_options`` in the request the member is inserted after the
    object's opening brace (the body is otherwise the client's bytes: parse_body
    proved it a JSON object, so its first non-blank byte is ``{`` followed by a
    member); with it, the body is re-serialised with ``include_usage`` set.
    """
    if "stream_options" not in payload:
        i = body.find(b"{")
        return body[:i + 1] + _INCLUDE_USAGE + body[i + 1:]
    opts = payload["stream_options"]
    payload = dict(payload)
    payload["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")


@functools.lru_cache(maxsize=1024)
def reset_text(seconds: float) -> str:
    """A duration as OpenAI writes it in ``x-ratelimit-reset-*``: ``20ms``, ``1.5s``, ``6m0s``.

    Cached: every answer of a limited key carries two, and uvloop's clock moves in
    whole milliseconds, so the requests of one millisecond ask for the same few values.
    """
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    if seconds < 60:
        return f"{math.ceil(seconds * 1000) / 1000:g}s"
    m, s = divmod(math.ceil(seconds), 60)
    return f"{m}m{s}s"


def _estimate(state: KeyState, parsed: ParsedRequest, body: bytes, path: str) -> tuple[int, int]:
    """(prompt, completion) to reserve before the engine says what the request used."""
    prompt = (len(body) + BYTES_PER_TOKEN - 1) // BYTES_PER_TOKEN
    return prompt, 0 if path.endswith("/embeddings") else _max_tokens(parsed.payload, state.limits.default_max_tokens)


def _max_tokens(payload: dict[str, Any], default: int) -> int:
    n = payload.get("n")
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
    for name in ("max_completion_tokens", "max_tokens"):
        v = payload.get(name)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            return v * n
    return default * n
