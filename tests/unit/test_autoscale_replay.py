"""The autoscaling benchmark's replay (benchmarks/autoscale/): its accounting on traces small
enough to work out by hand, so the GPU-hours and TTFT it reports are the ones it claims."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from llmgw.catalog import Autoscale

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "autoscale"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"autoscale_bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


rp = _load("replay")
tr = _load("trace")


def line(t_ms: int, inp: int, out: int, model: str = "m") -> dict:
    return {"timestamp": t_ms, "input_length": inp, "output_length": out, "model": model}


def test_static_gpu_hours_and_ttft_by_hand():
    # prefill 1 ms a token, 10 ms a token decoded, one request a replica at a time
    eng = rp.Engine(prefill=0.001, token=0.01, slowdown=0.0, max_batch=1)
    trace = [line(0, 100, 10), line(50, 100, 10), line(60, 100, 10)]
    res = rp.replay(trace, 3600.0, 2, eng, lead=90.0, fixed={"m": 2})
    m = res.models["m"]
    assert res.gpu_hours == pytest.approx(2.0)  # two replicas, the whole hour
    # first two go straight to a replica each: 0.1 s prefill + one 10 ms step; the third
    # waits for the first to finish at 0.2 s (0.1 prefill + 10 x 0.01)
    assert m.ttft == pytest.approx([0.11, 0.11, 0.2 - 0.06 + 0.11])
    assert m.max_queue == 1


def test_autoscaled_gpu_hours_count_starting_replicas_by_hand():
    # target 1 a replica: three long requests at 0.5 s leave two queued behind the one replica;
    # the first decision (t=2, after a stable window) panics to 3; the new replicas hold
    # their GPUs from t=2 but serve only from t=12 (lead 10 s)
    pol = Autoscale(max=3, min=1, target=1.0, stable_window=2.0, panic_window=1.0, tolerance=0.0,
                    scale_down_cooldown=1000.0)
    eng = rp.Engine(prefill=0.0, token=1.0, slowdown=0.0, max_batch=1)
    trace = [line(500, 10, 100), line(500, 10, 100), line(500, 10, 100)]
    res = rp.replay(trace, 50.0, 3, eng, lead=10.0, policies={"m": pol}, start={"m": 1})
    m = res.models["m"]
    assert m.decisions == [(2.0, 3, "panic")]
    assert m.gpu_seconds == pytest.approx(50.0 + 2 * 48.0)
    assert res.peak_placed == 3
    assert m.ttft == pytest.approx([1.0, 12.5, 12.5])


def test_a_pool_too_small_counts_the_cut_and_the_never_served():
    pol = Autoscale(max=3, min=1, target=1.0, stable_window=2.0, panic_window=1.0, tolerance=0.0,
                    scale_down_cooldown=1000.0)
    eng = rp.Engine(prefill=0.0, token=1.0, slowdown=0.0, max_batch=1)
    trace = [line(500, 10, 100)] * 3
    res = rp.replay(trace, 50.0, 1, eng, lead=10.0, policies={"m": pol}, start={"m": 1})
    m = res.models["m"]
    assert m.gpu_seconds == pytest.approx(50.0)
    # two replicas more wanted from t=2 on, passes at 2..50 (49 of 1 s each); the budget
    # (controlplane/autoscale_budget) grants only the pool's one, so none waits to be placed
    assert m.cut_seconds == pytest.approx(2 * 49.0)
    assert m.unplaced_seconds == 0.0
    assert m.ttft[1:] == [math.inf, math.inf]  # never served within the hour: windows miss


def test_drained_replicas_hold_their_gpu_until_their_requests_finish():
    # target 2 a replica: two requests (one on each of two replicas) run 0.5..10.5; the first
    # decision (t=2, stable average 1) asks for one replica, so one drains: it holds its GPU
    # until its request finishes at 10.5, then stops
    pol = Autoscale(max=2, min=1, target=2.0, stable_window=2.0, panic_window=1.0, tolerance=0.0,
                    scale_down_cooldown=0.0)
    eng = rp.Engine(prefill=0.0, token=1.0, slowdown=0.0, max_batch=1)
    trace = [line(500, 10, 10), line(500, 10, 10)]
    res = rp.replay(trace, 20.0, 2, eng, lead=10.0, policies={"m": pol}, start={"m": 2})
    m = res.models["m"]
    assert m.decisions == [(2.0, 1, "stable")]
    assert m.gpu_seconds == pytest.approx(20.0 + 10.5)
    assert m.ttft == pytest.approx([1.0, 1.0])


def test_reversals_and_the_most_in_one_cooldown():
    decisions = [(0, 1, "start"), (10, 2, "stable"), (20, 3, "stable"), (30, 2, "stable"),
                 (400, 3, "stable"), (500, 2, "stable")]
    assert rp.reversals(decisions) == [30, 400, 500]
    assert rp.most_in_span([30, 400, 500], 300.0) == 2
    assert rp.most_in_span([30, 330, 630], 300.0) == 1


def test_trace_is_seeded_and_mooncake_shaped(tmp_path):
    models = tr.default_models(peak_rps=2.0)
    a = tr.generate(models, day=600.0, seed=7)
    assert a == tr.generate(models, day=600.0, seed=7)
    assert a != tr.generate(models, day=600.0, seed=8)
    assert {"chat", "agent"} == {d["model"] for d in a}
    assert all(set(d) == {"timestamp", "input_length", "output_length", "model"} for d in a)
    assert [d["timestamp"] for d in a] == sorted(d["timestamp"] for d in a)
    p = tmp_path / "t.jsonl"
    assert tr.main(["--seed", "7", "--day", "600", "--peak-rps", "2", "--out", str(p)]) == 0
    assert tr.read_jsonl(str(p)) == a
    chat = models[0]
    assert tr.daily_factor(chat, chat.busiest_hour) == pytest.approx(1.0)
    assert tr.daily_factor(chat, chat.busiest_hour + 12) == pytest.approx(chat.trough)


def test_a_malformed_trace_line_is_named(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a Mooncake trace line"):
        tr.read_jsonl(str(p))


def test_run_writes_the_report_it_computed(tmp_path):
    # a quarter-hour "day" at a tenth of the load: the whole command, its files and its arithmetic
    run = _load("run")
    assert run.main(["--quick", "--day", "900", "--peak-rps", "3", "--scalers", "50", "--passes", "1",
                     "--out-dir", str(tmp_path)]) == 0
    import json
    r = json.loads((tmp_path / "autoscale.json").read_text())
    (seed,) = r["seeds"]
    assert seed["saving"] == pytest.approx(1 - seed["autoscaled"]["gpu_hours"] / seed["static"]["gpu_hours"], abs=1e-3)
    assert seed["static"]["gpu_hours"] == pytest.approx(sum(seed["static_counts"].values()) * 900 / 3600, abs=1e-3)
    assert r["decisions"]["decisions"] == 50
    md = (tmp_path / "autoscale.md").read_text()
    assert "| GPU-hours saved against static peak provisioning | >= 30 % |" in md
    assert "## When the pool is too small for both" in md
