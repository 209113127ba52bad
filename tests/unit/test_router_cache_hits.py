"""Predicted against reported cached tokens (router/cachehits.py): what is read from an answer, and
what is counted."""

from __future__ import annotations

import json

from aiohttp import web
from prometheus_client import generate_latest

from llmgw.router.cachehits import CacheHits
from llmgw.router.context import RequestContext
from llmgw.router.limitsgate import Limited
from llmgw.router.metrics import RouterMetrics
from llmgw.router.usage import StreamMeter, Usage, body_usage


def metric(m: RouterMetrics, name: str, **labels: str) -> float:
    v = m.registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


def answer(cached: int | None) -> bytes:
    usage = {"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return json.dumps({"id": "x", "choices": [{"text": "hi"}], "usage": usage}).encode()


def test_usage_reads_the_cached_tokens_when_the_engine_reports_them():
    assert body_usage(answer(32)) == Usage(40, 2, 32)
    assert body_usage(answer(None)) == Usage(40, 2, None)
    assert body_usage(answer(None).replace(b'"total_tokens"', b'"prompt_tokens_details":null,"total_tokens"')) \
        == Usage(40, 2, None)
    bad = json.loads(answer(0))
    bad["usage"]["prompt_tokens_details"]["cached_tokens"] = -1
    assert body_usage(json.dumps(bad).encode()).cached is None


def test_only_requests_the_index_placed_are_counted_and_an_unreported_one_apart():
    m = RouterMetrics()
    hits = CacheHits(["tiny"], m)
    ctx = RequestContext("r", 0.0)
    assert hits.admit(ctx, "other", False, {}, b"{}") == b"{}" and ctx.cache is None
    body = b'{"model":"tiny","prompt":"a"}'
    assert hits.admit(ctx, "tiny", False, {"model": "tiny"}, body) == body
    ctx.cache.predicted = 32
    hits.settle(ctx.cache, "tiny", web.Response(body=answer(30)))
    hits.settle(ctx.cache, "tiny", web.Response(body=answer(30)))  # settled once
    assert metric(m, "llmgw_router_cache_predicted_tokens_total", model="tiny") == 32
    assert metric(m, "llmgw_router_cache_reported_tokens_total", model="tiny") == 30
    assert metric(m, "llmgw_router_cache_predictions_total", model="tiny", outcome="reported") == 1
    ctx.cache.predicted = 16  # an engine without --enable-prompt-tokens-details: counted apart, not compared
    hits.settle(ctx.cache, "tiny", web.Response(body=answer(None)))
    assert metric(m, "llmgw_router_cache_predictions_total", model="tiny", outcome="unreported") == 1
    assert metric(m, "llmgw_router_cache_predicted_tokens_total", model="tiny") == 32
    hits.settle(ctx.cache, "tiny", web.Response(body=answer(8)))  # placed by prefix affinity: nothing
    assert metric(m, "llmgw_router_cache_reported_tokens_total", model="tiny") == 30
    assert b"llmgw_router_cache_predicted_tokens_total" in generate_latest(m.registry)


def test_a_stream_asks_for_its_usage_and_shares_a_limited_keys_meter():
    hits = CacheHits(["tiny"], RouterMetrics())
    ctx = RequestContext("r", 0.0)
    payload = {"model": "tiny", "prompt": "a", "stream": True}
    body = hits.admit(ctx, "tiny", True, payload, json.dumps(payload).encode())
    assert json.loads(body)["stream_options"] == {"include_usage": True} and ctx.cache.meter.strip
    asked = {"model": "tiny", "stream": True, "stream_options": {"include_usage": True}}
    ctx = RequestContext("r", 0.0)
    raw = json.dumps(asked).encode()
    assert hits.admit(ctx, "tiny", True, asked, raw) == raw and not ctx.cache.meter.strip
    ctx = RequestContext("r", 0.0)
    ctx.limits = Limited({}, None, StreamMeter(strip=True))
    assert hits.admit(ctx, "tiny", True, dict(payload), b"x") == b"x" and ctx.cache.meter is ctx.limits.meter
