"""The disaggregation benchmark's report builder (benchmarks/disagg/disagg_report.py) computes what it says."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "disagg"))

import poisson_load as client  # noqa: E402
import disagg_report as report  # noqa: E402

TRANSFER = {"per_token_us": 6.5, "prompt_tokens": 10_000, "prompt_ms": 65.0, "why": "stated"}


def run(layout: str, rate: float, itl_ms: list[float], ttft_ms: list[float], ok: int = 10, requests: int = 10,
        tokens: int = 1000, wall: float = 10.0, cpu: float | None = 0.05, counters=None) -> dict:
    return {"layout": layout, "rate": rate, "requests": requests, "ok": ok, "wall_s": wall,
            "ttft_s": [t / 1000 for t in ttft_ms], "itl_s": [g / 1000 for g in itl_ms],
            "tpot_s": [g / 1000 for g in itl_ms[:ok]], "output_tokens": tokens,
            "router_cpu_s": cpu, "counters": counters or {}}


def test_percentiles_are_nearest_rank():
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert report.percentile(values, 0.5) == 51.0  # rank round(0.5 x 99) = 50 (0-based)
    assert report.percentile(values, 0.99) == 99.0
    assert report.percentile(values, 1.0) == 100.0
    assert report.percentile([], 0.5) is None


def test_one_runs_figures():
    f = report.run_figures(run("aggregated", 1.0, itl_ms=[10.0] * 98 + [400.0, 500.0], ttft_ms=[500.0] * 10,
                               tokens=2000, wall=8.0, cpu=0.02))
    assert (f["itl_p50_ms"], f["itl_p90_ms"], f["itl_p99_ms"], f["itl_p999_ms"]) == (10.0, 10.0, 400.0, 500.0)
    assert f["ttft_p50_ms"] == 500.0
    assert f["output_tokens_per_s"] == 250.0  # 2000 tokens over 8 s
    assert f["router_cpu_us_per_request"] == 2000  # 0.02 s over 10 answered
    assert report.run_figures(run("aggregated", 1.0, [], [], ok=0, cpu=0.02))["router_cpu_us_per_request"] is None


def test_summary_takes_the_median_of_repeats_with_their_spread_and_sums_counts():
    runs = [run("disaggregated", 2.0, [10.0], [600.0], counters={"x": 1}),
            run("aggregated", 2.0, [30.0], [500.0], ok=9, counters={"x": 2}),
            run("aggregated", 2.0, [50.0], [520.0], counters={"x": 3}),
            run("aggregated", 2.0, [40.0], [510.0]),
            run("aggregated", 1.0, [20.0], [500.0])]
    rows = report.summarize(runs)
    assert [(r["rate"], r["layout"]) for r in rows] == [(1.0, "aggregated"), (2.0, "aggregated"),
                                                        (2.0, "disaggregated")]
    agg2 = rows[1]
    assert agg2["repeats"] == 3 and agg2["itl_p99_ms"] == 40.0 and agg2["itl_p99_ms_spread"] == [30.0, 50.0]
    assert (agg2["requests"], agg2["ok"], agg2["errors"]) == (30, 29, 1)
    assert agg2["counters"] == {"x": 5}


def test_a_difference_counts_only_beyond_the_spread():
    rows = report.summarize([run("aggregated", 1.0, [30.0], [500.0]), run("aggregated", 1.0, [50.0], [500.0]),
                             run("disaggregated", 1.0, [10.0], [600.0]), run("disaggregated", 1.0, [20.0], [700.0]),
                             run("aggregated", 2.0, [30.0], [500.0]), run("aggregated", 2.0, [50.0], [500.0]),
                             run("disaggregated", 2.0, [25.0], [600.0]), run("disaggregated", 2.0, [40.0], [600.0])])
    itl = report.compare(rows, "itl_p99_ms")
    assert [(c["rate"], c["better"]) for c in itl] == [(1.0, True), (2.0, None)]  # 2/s: 25-40 overlaps 30-50
    ttft = report.compare(rows, "ttft_p50_ms")
    assert [c["better"] for c in ttft] == [False, False]  # disaggregated's best is worse than aggregated's worst
    verdicts = {t["target"].split(" ")[0]: t["result"] for t in report.targets(rows, TRANSFER)}
    assert verdicts["ITL"] == verdicts["TPOT"] == "not met (1/s: better, 2/s: within spread)"
    assert verdicts["TTFT"] == "met" and verdicts["every"] == "met"
    # the same CPU in every run here: the two phases add nothing
    assert verdicts["the"] == ("met: two phases add +0 us at 1/s (within the repeats' spread), +0 us at 2/s "
                               "(within the repeats' spread) per request")
    rows = report.summarize([run("aggregated", 1.0, [1.0], [1.0], cpu=0.02), run("disaggregated", 1.0, [1.0], [1.0],
                                                                               cpu=0.035)])
    assert report.added_cpu(rows) == [(1.0, 1500)]  # 3500 - 2000 us over 10 requests


def test_nothing_is_met_that_was_not_measured():
    rows = report.summarize([run("aggregated", 1.0, [30.0], [500.0], cpu=None)])  # no disaggregated run
    results = [t["result"] for t in report.targets(rows, TRANSFER)]
    assert results[0] == "not measured" and results[2] == "not measured" and results[3] == "not measured"
    assert results[4] == results[5] == "not measured"
    assert results[6].startswith("not measured")
    md = report.markdown({"command": "c", "when": "d", "machine": "m", "summary": rows, "targets":
                          report.targets(rows, TRANSFER), "settings": {
                              "input_tokens": 10_000, "output_tokens": 1000, "duration_s": 12, "repeats": 1,
                              "engines": 4, "prefill": 2, "knobs": {"K": "1"}, "engine_args": ["--a"],
                              "transfer": TRANSFER, "prefill_ms": 500, "chunks_per_prompt": 2, "chunk_tokens": 8192}})
    assert "| aggregated | 10 (0) | 500 |" in md and "not measured" in md


def test_arrivals_are_poisson_and_repeatable():
    a = client.arrivals(2.0, 200.0, seed=7)
    assert a == client.arrivals(2.0, 200.0, seed=7) and a != client.arrivals(2.0, 200.0, seed=8)
    assert all(0 <= x < 200 for x in a) and a == sorted(a)
    assert len(a) == pytest.approx(400, rel=0.15)  # rate x duration


def test_every_prompt_is_distinct_from_its_first_word():
    import json
    one, two = (json.loads(client.body("m", n, "a", 50, 7)) for n in (0, 1))
    assert len(one["prompt"].split()) == 50 and one["max_tokens"] == 7 and one["stream"] is True
    assert one["prompt"].split()[0] != two["prompt"].split()[0]
