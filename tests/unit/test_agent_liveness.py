"""The liveness judgement (agent/liveness.py): when a Ready shard counts as no longer serving."""

from __future__ import annotations

import pytest

from llmgw.agent.liveness import (
    Check, Liveness, Progress, judge_engine, judge_process, observe,
    progress_from_samples, stalled,
)
from llmgw.promtext import totals
from llmgw.settings import LivenessPolicy, parse_agent_settings, policy_errors
from llmgw.config import ConfigInvalid

POLICY = LivenessPolicy(interval=1, timeout=1, fail_after=3)
BAD = Check(False, "health: no answer within 1s")
GOOD = Check(True, "ok")

VLLM_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 1.0
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="tiny"} 40.0
vllm:iteration_tokens_total_count{engine="0",model_name="tiny"} 42.0
vllm:iteration_tokens_total_sum{engine="0",model_name="tiny"} 97.0
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 50.0
vllm:generation_tokens_total{engine="0",model_name="tiny"} 47.0
"""


def run(checks: list[tuple[float, Check]], policy: LivenessPolicy = POLICY) -> list[str | None]:
    live, out = Liveness(last_ok=0.0), []
    for t, c in checks:
        live, reason = observe(live, c, t, policy)
        out.append(reason)
    return out


def test_failed_only_after_fail_after_without_a_passing_check():
    reasons = run([(1, BAD), (2, BAD), (3, BAD)])
    assert reasons[:2] == [None, None]
    assert reasons[2] is not None and "no passing health check for 3s" in reasons[2]
    assert "3 failed in a row" in reasons[2] and "health: no answer within 1s" in reasons[2]


def test_a_passing_check_resets_the_clock():
    assert run([(1, BAD), (2, BAD), (2.5, GOOD), (4, BAD), (5, BAD)]) == [None] * 5
    assert run([(1, BAD), (2, BAD), (2.5, GOOD), (4, BAD), (5.5, BAD)])[-1] is not None


def test_one_failure_never_fails_a_shard_however_long_the_gap():
    # a check that comes late (agent paused) and fails alone is not enough
    assert run([(100, BAD)]) == [None]
    assert run([(100, BAD), (101, BAD)])[-1] is not None


def test_stall_is_pending_at_both_reads_with_no_step_between():
    busy = Progress(pending=3, steps=100)
    assert stalled(busy, Progress(pending=2, steps=100))
    assert not stalled(busy, Progress(pending=2, steps=101))  # moving: slow is not stuck
    assert not stalled(Progress(pending=0, steps=100), Progress(pending=2, steps=100))  # just arrived
    assert not stalled(busy, Progress(pending=0, steps=100))  # idle now
    assert not stalled(None, busy)  # first read


def test_judge_engine():
    busy = Progress(pending=1, steps=7)
    assert judge_engine(True, "ok", None, busy).ok
    stuck = judge_engine(True, "ok", busy, Progress(pending=1, steps=7))
    assert not stuck.ok and "1 request(s) pending and no engine step" in stuck.detail
    down = judge_engine(False, "health: HTTP 500: ", busy, None)
    assert not down.ok and down.detail == "health: HTTP 500: "


def test_progress_survives_a_failed_check_without_metrics():
    """A /health failure reads no metrics; the next read must still compare with the last one."""
    live = Liveness(last_ok=0.0, progress=Progress(1, 7))
    live, _ = observe(live, Check(False, "health: HTTP 500"), 1, POLICY)
    assert live.progress == Progress(1, 7)


def test_page_totals_and_vllm_progress():
    samples = totals(VLLM_PAGE)
    assert samples["vllm:num_requests_running"] == 2.0
    p = progress_from_samples(samples, "vllm")
    assert p == Progress(pending=3, steps=42 + 97 + 50 + 47)


def test_other_engines_names_and_fallback_to_any_known():
    sg = totals('sglang:num_running_reqs{model_name="m"} 1\nsglang:num_queue_reqs{model_name="m"} 4\n'
                'sglang:generation_tokens_total{model_name="m"} 9\n')
    assert progress_from_samples(sg, "sglang") == Progress(5, 9)
    lc = totals("llamacpp:requests_processing 1\nllamacpp:requests_deferred 0\n"
                "llamacpp:tokens_predicted_total 12\nllamacpp:prompt_tokens_total 3\n")
    assert progress_from_samples(lc, "llamacpp") == Progress(1, 15)
    # an engine exposing another engine's names (the simulator speaks vLLM's) is still read
    assert progress_from_samples(totals(VLLM_PAGE), "sglang") is not None
    assert progress_from_samples(totals("process_cpu_seconds_total 3\n"), "vllm") is None
    assert progress_from_samples(totals("not prometheus at all {{{"), "vllm") is None


def test_process_states():
    assert judge_process("S").ok and judge_process("R").ok and judge_process("D").ok
    for st in (None, "Z", "X"):
        assert not judge_process(st).ok and "gone" in judge_process(st).detail
    assert "stopped" in judge_process("T").detail


def test_settings_defaults_and_validation(tmp_path):
    base = {"node_id": "n1", "control_plane": {"url": "wss://cp:8443/v1/agent/stream"},
            "tls": {"ca": "ca.pem", "cert": "c.pem", "key": "k.pem"}, "state_dir": str(tmp_path)}
    assert parse_agent_settings(base).health == LivenessPolicy()
    s = parse_agent_settings({**base, "health": {"interval": 0.2, "fail_after": 1, "timeout": 0.5}})
    assert s.health == LivenessPolicy(interval=0.2, timeout=0.5, fail_after=1, kill_after=5)
    with pytest.raises(ConfigInvalid) as e:
        parse_agent_settings({**base, "health": {"interval": 10, "fail_after": 5}})
    assert "/health/fail_after" in str(e.value) and "interval" in str(e.value)
    with pytest.raises(ConfigInvalid) as e:
        parse_agent_settings({**base, "health": {"interval": 0, "bogus": 1}})
    assert "/health/interval" in str(e.value) and "bogus" in str(e.value)
    assert list(policy_errors({"interval": 1, "fail_after": 1})) == []
