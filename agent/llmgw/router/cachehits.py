"""Cached tokens the route-key index predicted against those the engine reported.

When the cache-aware scorer places a request by its index, it predicts how many of the
prompt's tokens the chosen replica holds in its prefix cache (``CacheAware.predicted``: the
run of leading blocks its route keys cover). The engine says what it reused in the answer's
``usage.prompt_tokens_details.cached_tokens`` (vLLM with ``--enable-prompt-tokens-details``;
the engine simulator likewise). Both are counted per model
(``llmgw_router_cache_predicted_tokens`` and ``llmgw_router_cache_reported_tokens``), so an
operator sees whether the index tells the truth: predictions above the reported hits mean the
index keeps blocks the engines evicted (a lagging feed, tokenizers that disagree); below them,
it lags what the engines stored. A request whose answer does not say (an engine started without
the flag, a failure, a client that left) counts only in ``llmgw_router_cache_predictions``
(``unreported``), so one engine without the flag cannot skew the comparison.

Only requests of ``balancing.cache_aware.models`` are read. A stream is asked for its usage
event (``stream_options.include_usage``), which is cut from the client's stream when the
client did not ask for it, exactly as for a limited key (``limitsgate``: one meter serves
both); a whole answer's ``usage`` is found without decoding the rest of the body.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from aiohttp import web

from .limitsgate import with_include_usage
from .metrics import RouterMetrics
from .usage import StreamMeter, Usage, body_usage


@dataclass
class CacheProbe:
    """What a cache-aware model's request carries to its settlement (``RequestContext.cache``)."""

    meter: StreamMeter | None = None  # a stream's usage event; None: a whole answer's body is read
    predicted: int | None = None  # tokens the last try's replica was predicted to hold; None: not placed by the index


class CacheHits:
    def __init__(self, models: Iterable[str], metrics: RouterMetrics) -> None:
        self.models = frozenset(models)
        self.metrics = metrics
        self._children: dict[str, tuple] = {}

    def admit(self, ctx: Any, model: str, stream: bool, payload: dict[str, Any], body: bytes) -> bytes:
        """Start reading a cache-aware model's request (``ctx.cache``); the body to send.

        A stream shares a limited key's meter when it has one; otherwise it gets its own and,
        when the client did not ask for ``include_usage``, the body asks for it."""
        if model not in self.models:
            return body
        probe = ctx.cache = CacheProbe()
        if not stream:
            return body
        lim = ctx.limits
        if lim is not None and lim.meter is not None:
            probe.meter = lim.meter
            return body
        opts = payload.get("stream_options")
        asked = isinstance(opts, dict) and opts.get("include_usage") is True
        probe.meter = StreamMeter(strip=not asked)
        if not asked:
            body = with_include_usage(body, payload)
            # a body rebuilt from the payload (a disaggregated model's decode request) asks too
            payload["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
        return body

    def settle(self, probe: CacheProbe, model: str, resp: web.StreamResponse | None) -> None:
        """Count the request once it ended: only if the index placed its last try."""
        predicted, probe.predicted = probe.predicted, None  # settled once, however the handling ended
        if predicted is None:
            return
        c = self._children.get(model)
        if c is None:  # label children resolved once per model (labels() takes a lock)
            m = self.metrics
            c = self._children[model] = (
                m.cache_predicted_tokens.labels(model), m.cache_reported_tokens.labels(model),
                m.cache_predictions.labels(model, "reported"), m.cache_predictions.labels(model, "unreported"))
        used = _usage(probe, resp)
        if used is None or used.cached is None:
            c[3].inc()
            return
        c[2].inc()
        if predicted:
            c[0].inc(predicted)
        if used.cached:
            c[1].inc(used.cached)


def _usage(probe: CacheProbe, resp: web.StreamResponse | None) -> Usage | None:
    if probe.meter is not None:
        return probe.meter.usage
    if isinstance(resp, web.Response) and resp.status == 200 and isinstance(resp.body, bytes):
        return body_usage(resp.body)
    return None
