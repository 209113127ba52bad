"""The limits cost benchmark in its smallest form: both routers side by side, every figure and both tables written.

The full run (``python benchmarks/router/limits_cost.py``, about five minutes) is not for CI; this
runs the same program as its own process with one round of one second-long sample and a few
hundred in-process requests, and reads what it writes, so a router that no longer starts with
the benchmark's key, a load generator that no longer keeps a set rate, or a figure no longer
written fails here first.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

RUN = Path(__file__).resolve().parents[2] / "benchmarks" / "router" / "limits_cost.py"


def test_the_smallest_limits_cost_run_measures_both_routers_at_once_and_writes_both_tables(tmp_path):
    out = tmp_path / "limits"
    proc = subprocess.run([sys.executable, str(RUN), "--quick", "--out", str(out)], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0 and out.with_suffix(".json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.with_suffix(".json").read_text())
    (r,) = doc["rounds"]
    for figure in ("small-c16", "stream-64"):
        (sample,) = r["samples"][figure]
        for target in ("llmgw-1w-key", "llmgw-1w-limits"):
            assert sample[target]["us"] > 0 and sample[target]["ok"] > 0 and sample[target]["errors"] == 0, sample
    assert len(doc["micro"]) == 5
    md = out.with_suffix(".md").read_text()
    assert "| round | key µs/request |" in md and "## Where the difference goes" in md
