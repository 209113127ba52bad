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
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from .context import RequestContext
from .errors import INVALID_REQUEST, RATE_LIMIT, RouterError
from .limits import KeyState, Limiter, RateView, Refused, Ticket
from .metrics import RouterMetrics
from .request import ParsedRequest
from .usage import StreamMeter, Usage, body_usage

__all__ = ["LimitsGate", "Limited", "reset_text", "BYTES_PER_TOKEN"]

BYTES_PER_TOKEN = 4


@dataclass
class Limited:
    """What the request path keeps of a limited key's request (``RequestContext.limits``)."""

    headers: dict[str, str]
    ticket: Ticket | None = None
    meter: StreamMeter | None = None


class LimitsGate:
    def __init__(self, limiter: Limiter, metrics: RouterMetrics) -> None:
        self.limiter = limiter
        self.metrics = metrics

    def admit(self, ctx: RequestContext, state: KeyState, key: str, parsed: ParsedRequest, body: bytes,
              path: str) -> bytes:
        """Reserve for this request (``ctx.limits``) and return the body to send, or raise the refusal.

        A stream whose client did not ask for ``include_usage`` is sent with it
        (the body re-serialised), and the usage event is cut from what the
        client receives.
        """
        now = asyncio.get_running_loop().time()
        prompt = math.ceil(len(body) / BYTES_PER_TOKEN)
        completion = 0 if path.endswith("/embeddings") else _max_tokens(parsed.payload, state.limits.default_max_tokens)
        got = self.limiter.admit(state, key, parsed.model, prompt, completion, now)
        headers = self._headers(state, parsed.model, now)
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
                payload = dict(parsed.payload)
                payload["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
                body = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")
        return body

    def finish(self, lim: Limited, resp: web.StreamResponse | None, status: int) -> None:
        """Settle the request's reservation and put the rate-limit headers on an answer not yet sent."""
        if resp is not None and not resp.prepared:
            resp.headers.update(lim.headers)
        ticket = lim.ticket
        if ticket is None or ticket.settled:
            return
        used = self._used(lim, resp, status)
        self.limiter.settle(ticket, used.prompt, used.completion, asyncio.get_running_loop().time())
        self.metrics.key_usage(ticket.key, ticket.model, used.prompt, used.completion)

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

    def _headers(self, state: KeyState, model: str, now: float) -> dict[str, str]:
        req, tok = self.limiter.views(state, model, now)
        h: dict[str, str] = {}
        for suffix, view in (("requests", req), ("tokens", tok)):
            if view is not None:
                _put(h, suffix, view)
        return h


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


def _put(h: dict[str, str], suffix: str, view: RateView) -> None:
    h[f"x-ratelimit-limit-{suffix}"] = str(view.limit)
    h[f"x-ratelimit-remaining-{suffix}"] = str(view.remaining)
    h[f"x-ratelimit-reset-{suffix}"] = reset_text(view.reset)


def reset_text(seconds: float) -> str:
    """A duration as OpenAI writes it in ``x-ratelimit-reset-*``: ``20ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    if seconds < 60:
        return f"{math.ceil(seconds * 1000) / 1000:g}s"
    m, s = divmod(math.ceil(seconds), 60)
    return f"{m}m{s}s"


def _max_tokens(payload: dict[str, Any], default: int) -> int:
    n = payload.get("n")
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
    for name in ("max_completion_tokens", "max_tokens"):
        v = payload.get(name)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            return v * n
    return default * n
