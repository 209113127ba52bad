"""The fleet benchmark's short form: its stall, contention and failover phases run, and say what they cost.

The long run (1,000 to 10,000 simulated nodes, 10 s and 30 s stalls, the
control plane at half a core, a leader SIGKILLed beside its etcd standby) is
``python benchmarks/fleet/run.py``; this runs that same program with
``--quick`` (40 nodes, a 3 s stall, a 3 s lease) as its own process and reads
the figures it writes, so a phase that no longer runs, or a figure that is no
longer written, fails here before a long run finds it.  The suite runs the
benchmark; it never imports it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

RUN = Path(__file__).resolve().parents[2] / "benchmarks" / "fleet" / "run.py"


def test_the_quick_fleet_benchmark_pauses_starves_and_fails_over_a_fleet_and_counts_what_it_cost(tmp_path):
    out = tmp_path / "fleet"
    proc = subprocess.run([sys.executable, str(RUN), "--quick", "--out", str(out), "--keep-logs", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and out.with_suffix(".json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.with_suffix(".json").read_text())
    assert doc["yardstick"]["placement_decisions_per_s_1000_nodes"] > 0
    (r,) = doc["sizes"]
    assert r["cold"]["registrations_per_node"] == {"1": r["nodes"]}

    (paused,) = r["stall"].values()
    assert paused["noticed"], "the control plane did not log its own pause"
    assert (paused["streams_closed"], paused["nodes_unreachable"], paused["reregistrations"],
            paused["replicas_moved_or_restarted"]) == (0, 0, 0, 0), paused

    starved = r["contention"]
    assert starved["cpu_share"] == 0.5
    for phase in ("cold", "storm"):
        assert starved[phase]["converged"], starved
        assert starved[phase]["registrations_mean"] == 1.0, starved
        assert starved[phase]["tracebacks"] == 0, starved
    assert starved["storm"]["replicas_moved"] == starved["storm"]["replicas_restarted"] == 0

    fo = r["failover"]
    if shutil.which("etcd") is None:
        assert "skipped" in fo
        pytest.skip("etcd is not installed (make etcd): the failover phase was skipped, as it says")
    assert fo["new_leader_s"] is not None and fo["converged_s"] is not None, fo
    assert (fo["replicas_moved"], fo["replicas_restarted"], fo["nodes_lost"], fo["gpus_twice"]) == (0, 0, 0, 0), fo
    assert fo["registrations_mean"] == 1.0, fo
    md = out.with_suffix(".md").read_text()
    assert "## Stall, overload and failover" in md and "failover: SIGKILL of the leader" in md
