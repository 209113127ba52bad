"""The engines' own autoscaling signals read from /metrics pages as each pinned release writes them."""

from __future__ import annotations

import pytest

from llmgw.enginesignals import KV_CACHE_USE, QUEUE_DEPTH, engines_for, read_signal
from llmgw.sim.sim_metrics import SimMetrics

# vLLM 0.33 (v1/metrics/loggers.py): one series per engine core; the by-reason gauge shares the name's start
VLLM = """# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 3.0
vllm:num_requests_running{engine="0",model_name="m"} 8.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
"""
# before the v1 engine the KV gauge was gpu_cache_usage_perc
VLLM_OLD = 'vllm:num_requests_waiting{model_name="m"} 1.0\nvllm:gpu_cache_usage_perc{model_name="m"} 0.5\n'
# SGLang 0.5.23 with priority scheduling: the total under priority="" and a breakdown beside it
SGLANG = """sglang:num_queue_reqs{engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",priority="",tp_rank="0"} 5.0
sglang:num_queue_reqs{engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",priority="1",tp_rank="0"} 4.0
sglang:num_queue_reqs{engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",priority="2",tp_rank="0"} 1.0
sglang:token_usage{engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",priority="",tp_rank="0"} 0.61
sglang:full_token_usage{engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",priority="",tp_rank="0"} 0.5
"""
LLAMACPP = "# TYPE llamacpp:requests_deferred gauge\nllamacpp:requests_deferred 2\nllamacpp:requests_processing 4\n"


@pytest.mark.parametrize("page, engine, signal, value", [
    (VLLM, "vllm", QUEUE_DEPTH, 5.0),  # waiting adds up over the engine cores behind one server
    (VLLM, "vllm", KV_CACHE_USE, 0.75),  # KV use is the fullest core's
    (VLLM_OLD, "vllm", KV_CACHE_USE, 0.5),
    (SGLANG, "sglang", QUEUE_DEPTH, 5.0),  # the total, not total + breakdown
    (SGLANG, "sglang", KV_CACHE_USE, 0.61),
    (LLAMACPP, "llamacpp", QUEUE_DEPTH, 2.0),
    ("vllm:num_requests_waiting 4 1700000000000\n", "vllm", QUEUE_DEPTH, 4.0),  # a timestamp after the value
    ("vllm:num_requests_waiting 1e12\n", "vllm", QUEUE_DEPTH, 1e6),  # no more than the stream's schema takes
])
def test_each_engines_page_gives_its_signal(page, engine, signal, value):
    assert read_signal(page, engine, signal) == pytest.approx(value)


@pytest.mark.parametrize("page, engine, signal", [
    (LLAMACPP, "llamacpp", KV_CACHE_USE),  # llama-server exports no KV use
    (VLLM, "sglang", QUEUE_DEPTH),  # another engine's names are not read as this one's
    ("vllm:num_requests_waiting_by_reason{reason=\"capacity\"} 3\n", "vllm", QUEUE_DEPTH),
    ("vllm:num_requests_waiting NaN\nvllm:kv_cache_usage_perc -1\n", "vllm", QUEUE_DEPTH),
    ("vllm:num_requests_waiting{engine=\"0\"} lots\n", "vllm", QUEUE_DEPTH),
    ("", "vllm", KV_CACHE_USE),
    (VLLM, "trt", QUEUE_DEPTH),
])
def test_a_page_without_the_signal_gives_none(page, engine, signal):
    assert read_signal(page, engine, signal) is None


def test_which_engines_have_which_signal():
    assert engines_for(QUEUE_DEPTH) == ("llamacpp", "sglang", "vllm")
    assert engines_for(KV_CACHE_USE) == ("sglang", "vllm")
    assert engines_for("outstanding") == ()


@pytest.mark.parametrize("dialect, signals", [
    ("vllm", (QUEUE_DEPTH, KV_CACHE_USE)),
    ("sglang", (QUEUE_DEPTH, KV_CACHE_USE)),
    ("llamacpp", (QUEUE_DEPTH,)),
])
def test_the_simulator_shows_each_dialects_own_gauges(dialect, signals):
    m = SimMetrics("m", dialect=dialect)
    m.set_waiting(3)
    m.set_running(2)
    m.set_kv_usage(0.4)
    page = m.render().decode()
    got = {s: read_signal(page, dialect, s) for s in signals}
    assert got == {QUEUE_DEPTH: 3.0, KV_CACHE_USE: 0.4} if len(signals) == 2 else {QUEUE_DEPTH: 3.0}
    # and the vLLM names every dialect has always shown move with them
    assert read_signal(page, "vllm", QUEUE_DEPTH) == 3.0
