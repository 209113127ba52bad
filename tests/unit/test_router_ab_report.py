"""The router A/B report (benchmarks/router/ab.py): ratios per round, their median against the 5 % target."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "router_ab", Path(__file__).resolve().parents[2] / "benchmarks" / "router" / "ab.py")
ab = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = ab
spec.loader.exec_module(ab)

ARGS = argparse.Namespace(base="b", head="h", sim=None, repeat=3)


def side(req: list[float], chunk: list[float]) -> dict:
    return {"per_request_us": req, "per_chunk_us": chunk, "rps": 5000, "load": 2.0}


def test_the_median_ratio_over_rounds_decides_and_a_noisy_round_does_not():
    rounds = [{"base": side([100, 101, 99], [7.0]), "head": side([103, 104, 102], [7.2])},
              {"base": side([100], [7.0]), "head": side([130], [7.1])},  # one noisy round
              {"base": side([100], [7.0]), "head": side([102], [7.0])}]
    text = ab.report(rounds, ARGS)
    assert "| 1 | 100.00 | 103.00 | 1.030 |" in text
    assert "| CPU per request (small-c16) | ≤ 1.05x | 1.030 (1.020-1.300) | yes |" in text
    assert "| CPU per chunk (stream-64) | ≤ 1.05x | 1.014 (1.000-1.029) | yes |" in text


def test_a_candidate_dearer_in_most_rounds_is_not_met():
    rounds = [{"base": side([100], [7.0]), "head": side([107], [7.0])} for _ in range(3)]
    assert "| CPU per request (small-c16) | ≤ 1.05x | 1.070 (1.070-1.070) | no |" in ab.report(rounds, ARGS)
