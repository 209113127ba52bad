"""The router's per-key and per-source holdings (pure): which cap a request crosses, and giving back."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from llmgw.router.holdings import Caps, Holdings, Refusal
from llmgw.router.metrics import RouterMetrics

MIB = 1 << 20


def _take(h: Holdings, source: str, key: str | None, n: int):
    return h.take(h.by_source, source, n), (h.take(h.by_key, key, n) if key is not None else None)


def _give(h: Holdings, source: str, key: str | None, held, n: int) -> None:
    h.give(h.by_source, source, held[0], n)
    if key is not None:
        h.give(h.by_key, key, held[1], n)


def test_a_refusal_is_named_for_the_setting_that_refused_it():
    assert Refusal("key", "requests", 2).klass == "max_requests_per_key"
    assert Refusal("source", "body_bytes", MIB).klass == "max_body_bytes_per_source"
    assert Refusal("key", "requests", 2).reason == "2 requests in flight"
    assert Refusal("source", "body_bytes", MIB).reason == f"{MIB} bytes of request bodies in flight"


def test_requests_over_a_cap_are_refused_the_source_first():
    h = Holdings(Caps(requests_per_key=1, requests_per_source=2, body_bytes_per_key=0, body_bytes_per_source=0))
    assert h.check("a", "k", 10) is None
    first = _take(h, "a", "k", 10)
    assert h.check("a", "k", 10).klass == "max_requests_per_key"
    assert h.check("a", "other", 10) is None  # another key from the same address
    second = _take(h, "a", "other", 10)
    assert h.check("a", "k", 10).klass == "max_requests_per_source"  # both over: the source is named
    assert h.check("b", "k", 10).klass == "max_requests_per_key"  # the key, from anywhere
    assert h.check("b", None, 10) is None  # an anonymous caller is held to the source caps only
    _give(h, "a", "other", second, 10)
    _give(h, "a", "k", first, 10)
    assert h.by_key == {} and h.by_source == {}  # nothing left behind once nothing is in flight


def test_body_bytes_over_a_cap_are_refused_and_an_empty_body_never_is():
    h = Holdings(Caps(requests_per_key=0, requests_per_source=0, body_bytes_per_key=100, body_bytes_per_source=150))
    held = _take(h, "a", "k", 100)
    assert h.check("a", "k", 1).klass == "max_body_bytes_per_key"
    assert h.check("a", "k", 0) is None  # no body: no bytes to hold
    assert h.check("a", "j", 50) is None and h.check("a", "j", 51).klass == "max_body_bytes_per_source"
    _give(h, "a", "k", held, 100)
    assert h.check("a", "k", 100) is None


def test_a_cap_of_zero_is_no_cap():
    h = Holdings(Caps(0, 0, 0, 0))
    for _ in range(1000):
        _take(h, "a", "k", 64 * MIB)
    assert h.check("a", "k", 64 * MIB) is None


def test_a_body_grows_its_reservation_until_a_cap_and_a_refusal_reserves_nothing():
    h = Holdings(Caps(requests_per_key=0, requests_per_source=0, body_bytes_per_key=100, body_bytes_per_source=1000))
    other = _take(h, "b", "k", 30)  # the same key from elsewhere holds 30
    held = _take(h, "a", "k", 0)  # a chunked body: nothing reserved up front
    assert h.grow(held[0], held[1], 60) is None
    assert (h.by_source["a"].bytes, h.by_key["k"].bytes) == (60, 90)
    refusal = h.grow(held[0], held[1], 11)
    assert refusal is not None and refusal.klass == "max_body_bytes_per_key"
    assert (h.by_source["a"].bytes, h.by_key["k"].bytes) == (60, 90)  # unchanged by the refusal
    assert h.grow(held[0], held[1], 10) is None  # exactly at the cap is within it
    h.shrink(held[0], held[1], 70)
    _give(h, "a", "k", held, 0)
    assert h.by_key["k"].bytes == 30 and "a" not in h.by_source
    _give(h, "b", "k", other, 30)
    assert h.by_key == {} and h.by_source == {}


def test_the_source_cap_bounds_growth_of_an_anonymous_body():
    h = Holdings(Caps(requests_per_key=0, requests_per_source=0, body_bytes_per_key=10, body_bytes_per_source=100))
    held = _take(h, "a", None, 0)
    assert h.grow(held[0], None, 100) is None
    assert h.grow(held[0], None, 1).klass == "max_body_bytes_per_source"
    h.shrink(held[0], None, 100)
    _give(h, "a", None, held, 0)
    assert h.by_source == {}


def test_refusals_are_counted_as_answered_requests_of_no_model_and_as_errors_of_their_class():
    m = RouterMetrics(CollectorRegistry())
    m.refused(429, "max_requests_per_key", 0.0)
    m.refused(429, "max_requests_per_key", 0.0)
    m.refused(408, "body_timeout", 10.5)
    value = m.registry.get_sample_value
    assert value("llmgw_router_requests_total", {"model": "-", "status": "429"}) == 2
    assert value("llmgw_router_requests_total", {"model": "-", "status": "408"}) == 1
    assert value("llmgw_router_errors_total", {"model": "-", "class": "max_requests_per_key"}) == 2
    assert value("llmgw_router_errors_total", {"model": "-", "class": "body_timeout"}) == 1
    assert value("llmgw_router_request_duration_seconds_count", {"model": "-"}) == 3
    assert value("llmgw_router_request_duration_seconds_sum", {"model": "-"}) == 10.5
