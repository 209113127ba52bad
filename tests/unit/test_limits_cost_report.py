"""The limits cost page (benchmarks/router/limits_cost.py): a round's ratio is its samples' median, the figure
the rounds' median; the in-process steps (limits_path.py) run through the router's own gate."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "router"


def load(name: str):
    if name in sys.modules:
        return sys.modules[name]
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def pair(key: float, limits: float, rps: float = 1000) -> dict:
    return {"llmgw-1w-key": {"us": key, "rps": rps}, "llmgw-1w-limits": {"us": limits, "rps": rps}}


def saved(rounds: list[tuple[list[dict], list[dict]]]) -> dict:
    return {"args": {"rounds": len(rounds), "repeat": 3, "duration": 6.0, "warmup": 1.0},
            "rounds": [{"samples": {"small-c16": req, "stream-64": chunk}, "load": 2.0} for req, chunk in rounds]}


def test_a_rounds_ratio_is_the_median_of_its_side_by_side_samples_and_the_figure_the_rounds_median():
    lc = load("limits_cost")
    chunk = [pair(10.0, 10.5, 200)]
    rounds = [([pair(200, 216), pair(200, 260), pair(200, 214)], chunk),  # one noisy sample: the round says 1.080
              ([pair(100, 109)], chunk),
              ([pair(100, 150)], chunk)]  # one noisy round
    text = lc.report(saved(rounds), None)
    assert "| 1 | 200.0 | 216.0 | 1.080 | 10.0 | 10.5 | 1.050 | 1.000 | 2.0 |" in text
    assert ("| CPU per request (1 token, not streamed, 1,000 requests/s), limits on against off | ≤ 1.10x "
            "| 1.090 (1.080-1.500) | 1.070-1.500 | yes |") in text
    assert "| CPU per chunk (64-token streams, 200 streams/s), limits on against off | ≤ 1.10x | 1.050" in text


def test_a_rate_the_host_could_not_keep_shows_in_the_served_column():
    lc = load("limits_cost")
    text = lc.report(saved([([pair(200, 210, rps=900)], [pair(10.0, 10.5, 200)])]), None)
    assert "| 1 | 200.0 | 210.0 | 1.050 | 10.0 | 10.5 | 1.050 | 0.900 | 2.0 |" in text


def test_the_in_process_steps_run_the_router_gate_and_the_limited_answer_carries_the_six_headers():
    lp = load("limits_path")
    rows = lp.measure(n=50, repeat=2)
    assert [len(r["key_us"]) for r in rows] == [2] * len(rows) and len(lp.added(rows)) == 2
    table = "\n".join(lp.table(rows, 50))
    assert all(r["step"] in table for r in rows) and "whole answer" in table

    async def one_answer():
        _, gate = lp.gates()
        (ctx,) = lp.admitted(gate, 1)
        gate.finish(ctx.limits, resp := lp.answer(), 200)
        return ctx, resp

    ctx, resp = asyncio.run(one_answer())
    sent = [k for k in lp.wire_headers(resp) if k.startswith("x-ratelimit-")]
    assert len(sent) == 6 and ctx.limits.ticket.settled


def test_a_base_trees_limited_router_is_judged_against_the_same_key_only_router_and_against_this_trees():
    lc = load("limits_cost")

    def three(key: float, limits: float, base: float) -> dict:
        return {**pair(key, limits, 700), "llmgw-1w-limits-base": {"us": base, "rps": 700}}
    doc = saved([([three(200, 220, 230)], [three(10.0, 10.5, 11.0)])])
    doc["args"].update(rate_scale=0.7, base="main")
    text = lc.report(doc, None)
    assert "| CPU per request (1 token, not streamed, 700 requests/s) | 1.150 (1.150-1.150) | 0.957 (0.957-0.957) |" \
        in text
    assert "`llmgw-1w-limits-base` is the router of `main`" in text
