"""The catalog across a control-plane restart, and the restart backoff of failing shards.

Real ``llmgw server`` and ``llmgw agent`` processes with simulator engines;
process identity is pid plus start time from /proc, never pid alone.
"""

from __future__ import annotations

import re

import pytest

from fleet import Fleet, log_times, process_start_time, shard_identities, until

pytestmark = pytest.mark.integration


def alive(pid: int, start_time: int) -> bool:
    return process_start_time(pid) == start_time


def test_deployments_removed_while_the_control_plane_is_down_are_stopped_the_rest_untouched(tmp_path):
    with Fleet(tmp_path, nodes={"a": 3}, replicas=1) as f:
        f.config["models"] += [{"name": "two", "source": "org/two"}, {"name": "three", "source": "org/three"}]
        f.config["deployments"] += [{"model": "two", "profile": "sim", "replicas": 1},
                                    {"model": "three", "profile": "sim", "replicas": 1}]
        f.write_config()
        f.start()
        ready = {r["model"]: r for r in f.wait_ready(3)}
        assert set(ready) == {"tiny", "two", "three"}
        ids = shard_identities(f.replicas())
        procs = {m: ids[r["shards"][0]["shard_id"]] for m, r in ready.items()}
        assert len({p[1] for p in procs.values()}) == 3

        f.server.terminate()
        assert not f.server.alive()
        # While it is down: "two" loses its deployment (its model stays declared),
        # "three" leaves the catalog altogether.
        f.config["deployments"] = [d for d in f.config["deployments"] if d["model"] == "tiny"]
        f.config["models"] = [m for m in f.config["models"] if m["name"] != "three"]
        f.write_config()
        assert all(alive(p[1], p[2]) for p in procs.values()), "engines never stop because the control plane did"
        f.server.start()
        f.wait_healthy()

        for m in ("two", "three"):
            pid, start = procs[m][1], procs[m][2]
            until(lambda: not alive(pid, start), f"the engine of {m!r} stopped", on_timeout=f.dump)
        _, pid, start = procs["tiny"]
        assert alive(pid, start)
        until(lambda: f.engine_pids() == [pid], "only tiny's engine left", on_timeout=f.dump)
        (still,) = f.wait_ready(1)
        assert still["replica_id"] == ready["tiny"]["replica_id"]
        assert shard_identities(f.replicas())[still["shards"][0]["shard_id"]] == procs["tiny"]
        until(lambda: len(f.replicas()["replicas"]) == 1, "the stopped replicas gone from the API", on_timeout=f.dump)
        log = f.server.life_output()
        for m in ("two", "three"):
            assert f"{ready[m]['replica_id']}: stopping, {m}/sim is not in the catalog" in log, log[-4000:]
        assert f"{ready['tiny']['replica_id']}: stopping" not in log
        agent_log = f.agents["a"].output(10**7)
        for m in ("two", "three"):
            assert ready[m]["shards"][0]["shard_id"] in agent_log


def test_a_shard_that_keeps_failing_is_restarted_with_growing_delays(tmp_path):
    with Fleet(tmp_path, nodes={"a": 1}, replicas=1, restart={"backoff_initial": 1.0, "backoff_max": 30.0},
               profile={"env": {"LLMGW_SIM_FAULT": "exit-during-start"}}) as f:
        f.start()
        failed_re = re.compile(r": failed \(shard r0 on \S+ failed.*\); attempt (\d+) in ([\d.]+)s")

        def failures() -> list[tuple[int, float]]:
            return [(int(m.group(1)), float(m.group(2))) for m in failed_re.finditer(f.server.output(10**8))]

        seen_restarts: list[int] = []

        def four_failures() -> bool:
            doc = f.try_get("/v1/replicas")
            for r in (doc or {}).get("replicas", []):
                if not seen_restarts or seen_restarts[-1] != r["restarts"]:
                    seen_restarts.append(r["restarts"])
            return len(failures()) >= 4

        until(four_failures, "four failed attempts", on_timeout=f.dump)
        log = f.server.output(10**8)
        fails = failures()[:4]
        # The announced delays double: 1, 2, 4, 8 seconds before attempts 2..5.
        assert fails == [(2, 1.0), (3, 2.0), (4, 4.0), (5, 8.0)], fails
        failed_at = log_times(log, "); attempt ")[:4]
        placed_at = log_times(log, ": placed (")
        assert len(placed_at) >= 4, placed_at
        # Each next attempt was placed no sooner than its announced delay after the failure...
        waits = []
        for (attempt, delay), t_fail in zip(fails[:3], failed_at):
            nxt = next(t for t in placed_at if t >= t_fail)
            waits.append(nxt - t_fail)
            assert nxt - t_fail >= delay - 0.01, (attempt, delay, nxt - t_fail)
        # ...so the gaps between successive attempts grow.
        assert waits[0] < waits[1] < waits[2], waits
        starts = placed_at[:4]
        gaps = [b - a for a, b in zip(starts, starts[1:])]
        assert gaps[0] < gaps[2], gaps
        # The replica carries its restart count (placements so far minus one), rising one at a time.
        assert seen_restarts == sorted(seen_restarts) and seen_restarts[0] == 0, seen_restarts
        assert all(b - a == 1 for a, b in zip(seen_restarts, seen_restarts[1:])), seen_restarts
        # The agent saw the same: each attempt launched, exited during start, and the
        # next launch came later after each failure than after the one before.
        agent_log = f.agents["a"].output(10**8)
        launched = log_times(agent_log, ": pending -> starting")
        exited = log_times(agent_log, "starting -> failed (engine exited with status 1 during start)")
        assert len(launched) >= 4 and len(exited) >= 4, agent_log[-3000:]
        agent_waits = [launched[i + 1] - exited[i] for i in range(3)]
        assert all(w >= d - 0.05 for w, (_, d) in zip(agent_waits, fails)), (agent_waits, fails)
        assert agent_waits[0] < agent_waits[1] < agent_waits[2], agent_waits
