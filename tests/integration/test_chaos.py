"""Chaos under load, short form: a few SIGKILLs of each kind while streams flow through a standalone router.

The long run (20 control-plane kills, 10 agent kills, 3 engine kills, 3 of all
at once) is ``python benchmarks/chaos/run.py``; this runs the same code with
two kills of each process and one of all three at once.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

RUN = Path(__file__).resolve().parents[2] / "benchmarks" / "chaos" / "run.py"


def load_chaos():
    spec = importlib.util.spec_from_file_location("chaos_run", RUN)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["chaos_run"] = mod  # its dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


def test_sigkills_under_streaming_load_lose_no_answer_restart_no_engine_and_leave_no_orphan(tmp_path):
    chaos = load_chaos()
    plan = chaos.Plan(control_plane=2, agent=2, engine=1, all=1)
    r = chaos.Chaos(tmp_path, plan).run()
    assert r["ok"] > 0 and r["requests"] >= r["ok"]
    assert r["integrity_errors"] == 0, r["failure_samples"]
    # the only failures allowed: streams a dying engine cut after their first token, told to the client
    assert r["failed_requests"] == r["cut_midstream"], r["failure_samples"]
    for phase in ("control-plane", "agent"):
        assert r["phases"][phase]["failed_requests"] == 0, r["phases"][phase]
        assert r["phases"][phase]["engine_pid_changes"] == 0, "no engine restarted by a control-plane/agent kill"
    assert r["failures_outside_kill_windows"] == {}, r["failure_samples"]
    for phase in ("engine", "all"):
        p = r["phases"][phase]
        assert p["engine_pid_changes"] == p["engines_killed"], f"only the killed engine was replaced: {p}"
    assert r["gpus_twice_ever"] == []
    assert r["orphans_at_end"] == [] and all(p["orphans"] == 0 for p in r["phases"].values())
    assert r["server_tracebacks"] == 0
    # the router took each restarted control plane's table (the run waits for it; here: it was measured)
    assert all(k["router_resync_s"] is not None for k in r["kills"] if k["phase"] in ("control-plane", "all"))
