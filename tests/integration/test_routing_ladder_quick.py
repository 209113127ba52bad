"""The QPS-ladder benchmark in its quick form: every scorer runs through real processes, every figure is written.

The full ladder (``python benchmarks/routing/ladder.py``, about 15 minutes) is not for CI; this
runs the same program as its own process with ``--quick`` (4 engines, a small workload, one
rate; about 45 s here) and reads the results it writes, so a scorer that no longer starts, a
figure no longer written or a route-key feed that no longer reaches the router fails here first.
The suite runs the benchmark; it never imports it.

The hit-rate checks are what a scorer that follows prefixes earns and whether the route-key feed
reached the router: the engines' hit rate under cache-aware routing must beat least-outstanding's
(about twice it here), and the index must have placed requests. Whether cache-aware beats prefix
affinity is the full ladder's figure, not this one's: the quick form sends about 40 requests to
a fleet with cold caches, where the two place all but a few alike and a single request's prompt
moves the hit rate by more than the gap between them: three runs of the same code measured
cache-aware against prefix affinity at 32 / 28, 26 / 28 and 29 / 36 %.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

LADDER = Path(__file__).resolve().parents[2] / "benchmarks" / "routing" / "ladder.py"
FIGURES = ("ttft_p50_s", "ttft_p90_s", "output_tokens_per_s", "hit_rate", "router_cpu_us_per_request")


def test_the_quick_ladder_runs_every_scorer_and_cache_aware_routing_earns_more_hits(tmp_path):
    out = tmp_path / "ladder"
    proc = subprocess.run([sys.executable, str(LADDER), "--quick", "--out", str(out)], capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0 and out.with_suffix(".json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.with_suffix(".json").read_text())
    rows = {r["scorer"]: r for r in doc["summary"]}
    assert set(rows) == {"least-outstanding", "prefix-affinity", "cache-aware"}
    for r in rows.values():
        assert r["requests"] > 0 and r["errors"] == 0, r
        for figure in FIGURES:
            assert r[figure] is not None, (r["scorer"], figure)
        assert set(r["cpu_share"]) >= {"router", "engine_max", "engines", "control", "client", "machine"}
    hits = {s: r["hit_rate"] for s, r in rows.items()}
    assert hits["cache-aware"] > hits["least-outstanding"], hits
    assert rows["cache-aware"]["placed_by_index"] > 0.1, rows["cache-aware"]
    assert len(doc["targets"]) == 3
    md = out.with_suffix(".md").read_text()
    assert "## Targets" in md and "`LLMGW_SIM_PREFILL_TOKEN_LATENCY` | 0.0005" in md
