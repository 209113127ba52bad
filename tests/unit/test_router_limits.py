"""Per-key limits on a fake clock: every rule of ``router/limits.py``, the usage reader and the settings."""

from __future__ import annotations

import asyncio
import math
import random

import pytest

from llmgw.config import ConfigInvalid
from llmgw.router.limits import BUDGET, DAY, INPUT, TOTAL, Limiter, Refused, Ticket, Window
from llmgw.router.limitsgate import _headers, _max_tokens, reset_text
from llmgw.router.settings import ApiKey, KeyLimits, KeyRates, RouterSettings
from llmgw.router.usage import StreamMeter, Usage, body_usage

H = "a" * 64


def limiter(window: float = 60.0, default: int = 16, per_model=None, **rates) -> tuple[Limiter, object]:
    lim = KeyLimits(KeyRates(**rates), default, window, per_model or {})
    lm = Limiter([ApiKey("k", H, None, lim), ApiKey("free", "b" * 64, None)])
    return lm, lm.keys["k"]


def test_a_key_without_limits_has_no_state():
    lm, _ = limiter(requests_per_minute=1)
    assert set(lm.keys) == {"k"}


def test_requests_just_under_the_limit_pass_and_the_next_waits_for_the_oldest_slot():
    lm, st = limiter(requests_per_minute=3)
    for t in (0.2, 10.5, 20.0):
        assert isinstance(lm.admit(st, "k", "m", 0, 0, t), Ticket)
    r = lm.admit(st, "k", "m", 0, 0, 30.0)
    assert isinstance(r, Refused) and r.dimension == "requests"
    # the first request sat in slot 0 ([0, 1)): it stops counting once all of that second is 60 s old
    assert r.retry_after == pytest.approx(61.0 - 30.0)
    assert isinstance(lm.admit(st, "k", "m", 0, 0, 30.0 + r.retry_after - 0.01), Refused)
    assert isinstance(lm.admit(st, "k", "m", 0, 0, 30.0 + r.retry_after), Ticket)


def test_no_lockout_past_the_window():
    lm, st = limiter(requests_per_minute=2, tokens_per_minute=100)
    for _ in range(2):
        lm.admit(st, "k", "m", 10, 10, 5.0)
    for t in (5.0, 30.0, 65.9):  # refused, however often it retries, until the window has passed
        assert isinstance(lm.admit(st, "k", "m", 10, 10, t), Refused)
    assert isinstance(lm.admit(st, "k", "m", 10, 10, 66.0), Ticket)  # one slot (1 s) past the minute at most


def test_each_dimension_has_its_own_window_and_a_refusal_counts_nothing():
    lm, st = limiter(requests_per_minute=10, output_tokens_per_minute=100)
    assert isinstance(lm.admit(st, "k", "m", 5, 100, 0.0), Ticket)
    r = lm.admit(st, "k", "m", 5, 1, 1.0)
    assert isinstance(r, Refused) and r.dimension == "output_tokens"
    req, tok = lm.views(st, "m", 1.0)
    assert req[1] == 9  # the refused request took no request
    assert tok[1] == 0


@pytest.mark.parametrize("dim, rates, need", [
    ("input_tokens", {"input_tokens_per_minute": 50}, (40, 0)),
    ("output_tokens", {"output_tokens_per_minute": 50}, (0, 40)),
    ("tokens", {"tokens_per_minute": 50}, (20, 20)),
])
def test_token_windows(dim, rates, need):
    lm, st = limiter(**rates)
    assert isinstance(lm.admit(st, "k", "m", *need, 0.0), Ticket)
    r = lm.admit(st, "k", "m", *need, 0.5)
    assert isinstance(r, Refused) and r.dimension == dim


def test_settlement_gives_back_an_unused_reservation_and_charges_an_overrun():
    lm, st = limiter(tokens_per_minute=1000)
    t = lm.admit(st, "k", "m", 100, 800, 0.0)
    assert isinstance(lm.admit(st, "k", "m", 100, 800, 0.1), Refused)  # 900 reserved
    lm.settle(t, 90, 10, 0.2)
    assert lm.views(st, "m", 0.2)[1][1] == 900
    t2 = lm.admit(st, "k", "m", 100, 100, 0.3)
    lm.settle(t2, 100, 700, 0.4)  # the engine generated more than reserved (no max_tokens honoured)
    assert lm.views(st, "m", 0.4)[1][1] == 100
    lm.settle(t2, 0, 0, 0.5)  # a second settlement is ignored
    assert lm.views(st, "m", 0.5)[1][1] == 100


@pytest.mark.parametrize("weight, counted", [(1.0, 1000), (0.1, 1000 - 720), (0.0, 1000 - 800)])
def test_cached_prompt_tokens_count_their_weight_once_settled(weight, counted):
    """Admission reserves the whole prompt (what is cached is known from the answer only);
    settlement counts each cached prompt token at the key's cached_prompt_weight."""
    lim = KeyLimits(KeyRates(tokens_per_minute=5000, input_tokens_per_minute=5000, tokens_per_day=50_000), 16,
                    cached_prompt_weight=weight)
    lm = Limiter([ApiKey("k", H, None, lim)])
    st = lm.keys["k"]
    t = lm.admit(st, "k", "m", 900, 100, 0.0)
    assert isinstance(t, Ticket) and lm.views(st, "m", 0.0)[1][1] == 5000 - 1000  # all of it reserved
    lm.settle(t, 900, 100, 0.1, cached=800)
    prompt = counted - 100
    assert lm.views(st, "m", 0.1)[1][1] == 5000 - counted
    assert {dim: w.used for dim, w in st.rule.windows} == {INPUT: prompt, TOTAL: counted, BUDGET: counted}
    # never more cached than the prompt: a wrong figure from an engine cannot make usage negative
    t2 = lm.admit(st, "k", "m", 10, 0, 0.2)
    lm.settle(t2, 10, 0, 0.3, cached=10_000)
    assert all(w.used >= 0 for _, w in st.rule.windows)


def test_settling_after_the_slot_aged_out_changes_nothing():
    lm, st = limiter(tokens_per_minute=1000)
    t = lm.admit(st, "k", "m", 100, 500, 0.0)
    assert lm.views(st, "m", 61.0)[1][1] == 1000
    lm.settle(t, 100, 0, 61.0)  # a long stream ended after its window passed
    assert lm.views(st, "m", 61.0)[1][1] == 1000
    assert st.rule.in_flight == 0


def test_concurrency_is_held_until_settlement():
    lm, st = limiter(concurrent_requests=2)
    a = lm.admit(st, "k", "m", 1, 1, 0.0)
    lm.admit(st, "k", "m", 1, 1, 0.0)
    r = lm.admit(st, "k", "m", 1, 1, 0.0)
    assert isinstance(r, Refused) and r.dimension == "concurrent_requests"
    lm.settle(a, 1, 1, 0.1)
    assert isinstance(lm.admit(st, "k", "m", 1, 1, 0.1), Ticket)


def test_the_day_budget_counts_reservations_and_admits_nothing_over_it():
    lm, st = limiter(tokens_per_day=1000)
    held = [lm.admit(st, "k", "m", 100, 150, float(i)) for i in range(4)]
    assert all(isinstance(t, Ticket) for t in held)
    r = lm.admit(st, "k", "m", 1, 0, 10.0)  # 1000 reserved, none settled yet
    assert isinstance(r, Refused) and r.dimension == "tokens_per_day"
    for t in held:
        lm.settle(t, 100, 100, 20.0)
    assert isinstance(lm.admit(st, "k", "m", 100, 100, 20.0), Ticket)  # 800 used, 200 left
    r = lm.admit(st, "k", "m", 1, 0, 30.0)
    assert isinstance(r, Refused) and r.retry_after == pytest.approx(60.0 + DAY - 30.0)


def test_a_request_larger_than_a_limit_is_never_admitted_and_never_waits():
    lm, st = limiter(output_tokens_per_minute=100)
    r = lm.admit(st, "k", "m", 0, 101, 0.0)
    assert isinstance(r, Refused) and math.isinf(r.retry_after)


def test_per_model_limits_apply_on_top_of_the_key():
    lm, st = limiter(requests_per_minute=3, per_model={"big": KeyRates(requests_per_minute=1)})
    assert isinstance(lm.admit(st, "k", "big", 0, 0, 0.0), Ticket)
    r = lm.admit(st, "k", "big", 0, 0, 0.0)
    assert isinstance(r, Refused) and r.dimension == "requests"
    assert isinstance(lm.admit(st, "k", "small", 0, 0, 0.0), Ticket)
    assert isinstance(lm.admit(st, "k", "small", 0, 0, 0.0), Ticket)
    assert isinstance(lm.admit(st, "k", "small", 0, 0, 0.0), Refused)  # the key's own 3
    assert lm.views(st, "big", 0.0)[0][1] == 0


def test_a_window_never_holds_more_than_its_limit_in_any_span():
    """Random arrivals against a sliding window: in every 60 s interval, at most ``limit`` admitted."""
    rnd = random.Random(31)
    w = Window(20, 60.0, 60)
    admitted = []
    t = 0.0
    for _ in range(3000):
        t += rnd.expovariate(1.0)
        if w.wait(1, t) == 0:
            w.add(1, t)
            admitted.append(t)
    j = 0
    for i, a in enumerate(admitted):
        while admitted[j] <= a - 60.0:
            j += 1
        assert i - j + 1 <= 20
    assert len(admitted) > 20 * (t / 61.0) * 0.95  # and the limit is used, not undershot


def test_reset_text_and_reserved_completion():
    assert reset_text(0.02) == "20ms" and reset_text(1.5) == "1.5s" and reset_text(360) == "6m0s"
    assert _max_tokens({"max_tokens": 7}, 16) == 7
    assert _max_tokens({"max_completion_tokens": 5, "max_tokens": 7}, 16) == 5
    assert _max_tokens({"n": 3}, 16) == 48
    assert _max_tokens({"max_tokens": True}, 16) == 16


def test_usage_from_a_body_and_a_stream():
    assert body_usage(b'{"usage": {"prompt_tokens": 3, "completion_tokens": 4}}') == Usage(3, 4)
    assert body_usage(b'{"usage":{"prompt_tokens":3,"total_tokens":3}}') == Usage(3, 0)  # embeddings
    assert body_usage(b'{"choices":[]}') is None and body_usage(b'{"usage":{"prompt_tokens":-1}}') is None
    tok = b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
    use = b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2}}\n\n'
    m = StreamMeter(strip=True)
    assert m.see(tok + tok) == tok + tok
    assert m.see(use + b"data: [DONE]\n\n") == b"data: [DONE]\n\n"  # the client did not ask for it
    assert m.charged(50) == Usage(9, 2)
    kept = StreamMeter(strip=False)
    assert kept.see(tok + use) == tok + use
    cut = StreamMeter(strip=True)
    cut.see(tok * 3)
    assert cut.charged(50) == Usage(50, 3)  # the client left: the estimate and one token per event


def _doc(limits, models="*"):
    return {"insecure_http": True, "api_keys": [{"name": "a", "sha256": H, "models": models, "limits": limits}]}


def test_settings_parse_limits():
    s = RouterSettings.from_config(_doc({"requests_per_minute": 5, "per_model": {"m": {"tokens_per_day": 5000}}}))
    lim = s.api_keys[0].limits
    assert lim.rates.requests_per_minute == 5 and lim.default_max_tokens == 1024 and lim.window_seconds == 60
    assert lim.per_model["m"].tokens_per_day == 5000
    assert RouterSettings.from_config(_doc({})).api_keys[0].limits == KeyLimits()


@pytest.mark.parametrize("limits, models, pointer", [
    ({"requests_per_minute": 0}, "*", "/api_keys/0/limits/requests_per_minute"),
    ({"tokens_per_minute": "lots"}, "*", "/api_keys/0/limits/tokens_per_minute"),
    ({"rpm": 3}, "*", "/api_keys/0/limits/rpm"),
    ({"per_model": {"x/y": {"requests_per_minute": 1}}}, ["m"], "/api_keys/0/limits/per_model/x~1y"),
    ({"per_model": {"m": {"burst": 1}}}, "*", "/api_keys/0/limits/per_model/m/burst"),
    ({"output_tokens_per_minute": 100}, "*", "/api_keys/0/limits/output_tokens_per_minute"),  # < default 1024
])
def test_bad_limits_are_named_by_pointer(limits, models, pointer):
    with pytest.raises(ConfigInvalid) as e:
        RouterSettings.from_config(_doc(limits, models))
    assert pointer in [err.pointer for err in e.value.errors], str(e.value)


def test_include_usage_is_added_to_a_stream_request():
    import json

    from llmgw.router.limitsgate import with_include_usage

    body = b' {"model":"m","stream":true,"messages":[]}'
    out = json.loads(with_include_usage(body, json.loads(body)))
    assert out == {"model": "m", "stream": True, "messages": [], "stream_options": {"include_usage": True}}
    body = b'{"model":"m","stream":true,"stream_options":{"continuous_usage_stats":false}}'
    out = json.loads(with_include_usage(body, json.loads(body)))
    assert out["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}


def test_body_usage_reads_only_the_usage_object_and_is_not_fooled_by_text():
    tricky = b'{"choices":[{"message":{"content":"\\"usage\\": {\\"prompt_tokens\\": 99}"}}],"usage":{"prompt_tokens":2,"completion_tokens":1}}'
    assert body_usage(tricky) == Usage(2, 1)
    assert body_usage(b'{"choices":[{"message":{"content":"usage"}}]}') is None


@pytest.mark.parametrize("body, usage", [
    (b'{"usage":{"prompt_tokens":7,"total_tokens":9,"completion_tokens":2}}', Usage(7, 2)),
    (b'{"usage": {"prompt_tokens": 7, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 3}}}',
     Usage(7, 2, 3)),  # nested details: the object is decoded, the cached tokens read
    # vLLM's own compact serialisation (read without decoding), and near misses that are decoded
    (b'{"x":1,"usage":{"prompt_tokens":7,"total_tokens":9,"completion_tokens":2,"prompt_tokens_details":null,'
     b'"completion_tokens_details":null}}', Usage(7, 2)),
    (b'{"usage":{"prompt_tokens":7,"total_tokens":9,"completion_tokens":2,'
     b'"prompt_tokens_details":{"cached_tokens":3}}}', Usage(7, 2, 3)),
    (b'{"usage":{"prompt_tokens":7,"total_tokens":9,"completion_tokens":2,'
     b'"prompt_tokens_details":{"cached_tokens":3,"audio_tokens":1}}}', Usage(7, 2, 3)),
    (b'{"usage":{"prompt_tokens":07,"total_tokens":9,"completion_tokens":2,"prompt_tokens_details":null}}', None),
    (b'{"usage":{"prompt_tokens":7,"total_tokens":9,"completion_tokens":-2,"prompt_tokens_details":null}}', None),
    (b'{"usage":{"prompt_tokens":7.5,"completion_tokens":2}}', None),
    (b'{"usage":{"completion_tokens":2}}', None),
    # vLLM's shape with a count too long for int(): not an answer to settle from, never an exception
    (b'{"usage":{"prompt_tokens":' + b"1" * 5000 + b',"total_tokens":9,"completion_tokens":2,'
     b'"prompt_tokens_details":null}}', None),
])
def test_body_usage_shapes(body, usage):
    assert body_usage(body) == usage


def test_a_reload_keeps_the_windows_of_unchanged_limits_and_renews_changed_ones():
    same = KeyLimits(KeyRates(requests_per_minute=2))
    lm = Limiter([ApiKey("a", H, None, same), ApiKey("b", "b" * 64, None, same)])
    for k in ("a", "b"):
        lm.admit(lm.keys[k], k, "m", 0, 0, 0.0)
        lm.admit(lm.keys[k], k, "m", 0, 0, 0.0)
    lm.replace([ApiKey("a", H, None, same), ApiKey("b", "b" * 64, None, KeyLimits(KeyRates(requests_per_minute=3))),
                ApiKey("c", "c" * 64, None)])
    assert isinstance(lm.admit(lm.keys["a"], "a", "m", 0, 0, 1.0), Refused)  # a reload forgives nothing
    assert isinstance(lm.admit(lm.keys["b"], "b", "m", 0, 0, 1.0), Ticket)  # new limits, new books
    assert set(lm.keys) == {"a", "b"}


def test_a_restarted_worker_starts_from_the_reloaded_keys(tmp_path):
    import yaml

    from llmgw.router.limitsreload import reloaded_doc

    path = tmp_path / "router.yaml"
    old = {"insecure_http": True, "workers": 2, "api_keys": [{"name": "a", "sha256": H}]}
    new_keys = [{"name": "b", "sha256": "b" * 64, "limits": {"requests_per_minute": 3}}]
    path.write_text(yaml.safe_dump({**old, "workers": 4, "api_keys": new_keys}))
    assert reloaded_doc(old, str(path)) == {**old, "api_keys": new_keys}  # workers: only at a restart
    path.write_text(yaml.safe_dump({**old, "api_keys": [{"name": "b", "sha256": "nothex"}]}))
    assert reloaded_doc(old, str(path)) == old


def test_a_limited_stream_asks_the_engine_for_usage_in_the_body_and_in_what_is_rebuilt_from_it():
    import asyncio
    import json

    from llmgw.router.context import RequestContext
    from llmgw.router.limitsgate import LimitsGate
    from llmgw.router.metrics import RouterMetrics
    from llmgw.router.prefill import decode_body
    from llmgw.router.request import parse_body

    lm, st = limiter(requests_per_minute=5)
    gate = LimitsGate(lm, RouterMetrics())
    body = b'{"model":"m","stream":true,"messages":[]}'
    parsed = parse_body(body)

    async def admit():
        ctx = RequestContext("r", 0.0)
        return ctx, await gate.admit(ctx, st, "k", parsed, body, "/v1/chat/completions")

    ctx, sent = asyncio.run(admit())
    assert json.loads(sent)["stream_options"] == {"include_usage": True}
    assert json.loads(decode_body(parsed.payload, {"x": 1}))["stream_options"] == {"include_usage": True}
    assert ctx.limits.meter.strip and ctx.limits.headers["x-ratelimit-remaining-requests"] == "4"


def test_a_whole_answer_is_reserved_without_a_coroutine_settled_from_its_usage_and_refused_past_the_limit():
    from aiohttp import web

    from llmgw.router.context import RequestContext
    from llmgw.router.errors import RouterError
    from llmgw.router.limitsgate import LimitsGate
    from llmgw.router.metrics import RouterMetrics
    from llmgw.router.request import parse_body

    lm, st = limiter(requests_per_minute=2, tokens_per_minute=1000, input_tokens_per_minute=1000)
    gate = LimitsGate(lm, RouterMetrics())
    body = b'{"model":"m","max_tokens":100,"messages":[]}'  # reserves 11 + 100 tokens
    answer = (b'{"choices":[],"usage":{"prompt_tokens":7,"total_tokens":9,"completion_tokens":2,'
              b'"prompt_tokens_details":{"cached_tokens":3},"completion_tokens_details":null}}')
    (total,) = [w for dim, w in st.rule.windows if dim == TOTAL]
    (prompts,) = [w for dim, w in st.rule.windows if dim == INPUT]

    async def run():
        seen = []
        for _ in range(2):
            ctx = RequestContext("r", 0.0)
            assert gate.reserve(ctx, st, "k", parse_body(body), body, "/v1/chat/completions") == body
            assert total.used == len(seen) * 9 + 111  # the estimate, until settled
            resp = web.Response(body=answer)
            gate.finish(ctx.limits, resp, 200)
            seen.append((resp.headers["x-ratelimit-remaining-requests"], resp.headers["x-ratelimit-remaining-tokens"]))
        assert total.used == 18 and prompts.used == 14  # the engine's 7 + 2, twice
        assert seen == [("1", "889"), ("0", "880")]  # as of each admission
        ctx = RequestContext("r", 0.0)
        with pytest.raises(RouterError) as e:
            gate.reserve(ctx, st, "k", parse_body(body), body, "/v1/chat/completions")
        assert e.value.status == 429 and ctx.limits.headers["x-ratelimit-remaining-requests"] == "0"
        gate.usage_counts.flush()

    asyncio.run(run())


def test_usage_counters_reach_prometheus_in_one_batch_a_second_after_the_first_request():
    from prometheus_client import CollectorRegistry

    from llmgw.router.limitsgate import UsageCounters
    from llmgw.router.metrics import RouterMetrics

    async def scenario() -> list[float]:
        reg = CollectorRegistry()
        counts = UsageCounters(RouterMetrics(reg))
        counts.FLUSH_AFTER = 0.05

        def seen() -> list[float]:
            return [reg.get_sample_value(f"llmgw_router_key_{n}_total", {"key": "k", "model": "m"}) or 0
                    for n in ("requests", "prompt_tokens", "completion_tokens", "cached_prompt_tokens")]
        counts.add("k", "m", 10, 3, 4)
        counts.add("k", "m", 5, 2, 0)
        before = seen()
        await asyncio.sleep(0.2)  # the timer the first add set
        after = seen()
        counts.add("k", "m", 1, 1, 0)
        counts.flush()  # as at shutdown: nothing waits for the timer
        return before + after + seen()

    got = asyncio.run(scenario())
    assert got[:4] == [0, 0, 0, 0]  # nothing per request
    assert got[4:8] == [2, 15, 5, 4]  # both requests, in one batch
    assert got[8:] == [3, 16, 6, 4]


def test_a_metered_buffer_takes_the_pending_bytes_counts_events_and_strips_a_split_usage_event():
    from llmgw.router.sse import EventBuffer

    buf = EventBuffer()
    assert buf.feed(b'data: {"choices":[{"text":"a"}]}\n\ndata: {"cho') == b'data: {"choices":[{"text":"a"}]}\n\n'
    meter = StreamMeter(strip=True)
    metered = meter.wrap(buf)  # a buffer too: the splice feeds it as it feeds any
    assert isinstance(metered, EventBuffer) and metered.pending == b'data: {"cho'
    out = [metered.feed(b'ices":[{"text":"b"}]}\n\n'),
           metered.feed(b'data: {"choices":[],"usage":{"prompt_tokens":7,'),
           metered.feed(b'"completion_tokens":2}}\n\ndata: [DONE]\n\n')]
    assert out == [b'data: {"choices":[{"text":"b"}]}\n\n', b"", b"data: [DONE]\n\n"]
    assert meter.usage == Usage(7, 2) and meter.events == 3  # b, the usage event, [DONE]
    assert meter.charged(99) == Usage(7, 2)


@pytest.mark.parametrize("req, tok, names", [
    ((10, 9, 0.0005), (500, 400, 2.5), ["limit-requests", "remaining-requests", "reset-requests", "limit-tokens",
                                         "remaining-tokens", "reset-tokens"]),
    ((10, 9, 0.0005), None, ["limit-requests", "remaining-requests", "reset-requests"]),
    (None, (500, 400, 2.5), ["limit-tokens", "remaining-tokens", "reset-tokens"]),
    (None, None, []),
])
def test_rate_limit_headers_name_each_kind_the_key_is_limited_in_and_no_other(req, tok, names):
    h = _headers(req, tok)
    assert list(h) == [f"x-ratelimit-{n}" for n in names]
    values = {"limit-requests": "10", "remaining-requests": "9", "reset-requests": "1ms", "limit-tokens": "500",
              "remaining-tokens": "400", "reset-tokens": "2.5s"}
    assert h == {f"x-ratelimit-{n}": values[n] for n in names}
