"""The disaggregation benchmark in its smallest form: both layouts run and every figure is written.

The full run (``python benchmarks/disagg/run.py``, about 6 minutes) is not for CI; this runs the
same program as its own process with two engines, a second of arrivals and ten-token answers,
and reads the results it writes, so a layout that no longer starts, a two-phase path the
router no longer takes, or a figure no longer written fails here first. The suite runs the
benchmark; it never imports it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

RUN = Path(__file__).resolve().parents[2] / "benchmarks" / "disagg" / "run.py"


def test_the_smallest_disaggregation_benchmark_serves_both_layouts_and_writes_every_figure(tmp_path):
    out = tmp_path / "disagg"
    argv = [sys.executable, str(RUN), "--engines", "2", "--prefill", "1", "--rates", "4", "--duration", "1",
            "--input-tokens", "2000", "--output-tokens", "10", "--repeat", "1", "--out", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and out.with_suffix(".json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.with_suffix(".json").read_text())
    rows = {r["layout"]: r for r in doc["summary"]}
    assert set(rows) == {"aggregated", "disaggregated"}
    for r in rows.values():
        assert r["requests"] > 0 and r["errors"] == 0, r
        for figure in ("ttft_p99_ms", "tpot_p50_ms", "itl_p99_ms", "output_tokens_per_s", "router_cpu_us_per_request"):
            assert r[figure] is not None, (r["layout"], figure)
    dis = rows["disaggregated"]["counters"]
    n = rows["disaggregated"]["requests"]
    # every request went through two phases, and its decoder pulled the prompt instead of prefilling it
    assert dis["router prefill ok"] == n and dis["decode engines: vllm:nixl_xfer_time_seconds_count"] == n, dis
    assert dis["decode engines: llmgw_sim:prefill_chunks_total"] == 0, dis
    assert rows["aggregated"]["counters"]["both engines: llmgw_sim:prefill_chunks_total"] >= n
    md = out.with_suffix(".md").read_text()
    assert "## Targets" in md and "6.5 us per prompt token" in md
