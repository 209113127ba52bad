"""A wedged engine is found by its agent and replaced, with clients streaming through the router.

Real processes throughout: control plane with its router, two agents, engines
(the simulator through the vLLM adapter), and the official ``openai`` client.
The engine's fault begins on SIGUSR1 after it has served: its process lives
and nothing it serves answers any more, /health included.  The agent's checks
(short detection time from ``agent.yaml`` ``health``) fail the shard, the
control plane restarts the replica, and the router has already stopped
sending to it: first-token timeouts retry on the healthy replica, so no
client request fails.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from fleet import Fleet, edit_agent_config, until
from openai_load import OpenAIStreams

pytestmark = pytest.mark.integration

HEALTH = {"interval": 0.5, "timeout": 1.0, "fail_after": 3.0, "kill_after": 1.0}
PROFILE = {"env": {"LLMGW_SIM_TOKEN_LATENCY": "0.01", "LLMGW_SIM_FAULT": "wedge", "LLMGW_SIM_FAULT_ONSET": "signal"}}
# A request the wedged engine swallows is retried elsewhere after first_token; the
# retry budget's floor is raised because two client threads make a small window.
ROUTER = {"timeouts": {"connect": 1, "first_token": 1.5, "per_try": 10},
          "outlier": {"consecutive_errors": 2}, "retries": {"budget_min": 10}}


def fleet(tmp_path) -> Fleet:
    f = Fleet(tmp_path, nodes={"a": 1, "b": 1}, replicas=2, router=True, profile=PROFILE)
    f.config["router"].update(ROUTER)
    f.write_config()
    for agent in f.agents.values():
        edit_agent_config(agent, lambda doc: doc.update(health=HEALTH))
    return f


def test_wedged_engine_is_replaced_with_no_failed_request_and_the_reason_shown(tmp_path):
    with fleet(tmp_path) as f:
        f.start()
        ready = f.wait_ready(2)
        victim = ready[0]
        slot = victim["replica_id"].rsplit("-", 1)[0]
        pid = victim["shards"][0]["pid"]
        load = OpenAIStreams(f.router_url, verify=f.router_verify()).start()
        try:
            until(lambda: load.count() >= 5, "streams flowing", on_timeout=f.dump)
            t0 = time.monotonic()
            os.kill(pid, signal.SIGUSR1)

            def gone() -> bool:
                ids = {r["replica_id"] for r in f.ready_replicas()}
                return victim["replica_id"] not in ids
            until(gone, "the wedged replica to leave Ready", on_timeout=f.dump)
            detected = time.monotonic() - t0

            def replaced() -> list | None:
                rs = f.ready_replicas()
                new = [r for r in rs if r["replica_id"].startswith(slot + "-") and r["replica_id"] != victim["replica_id"]]
                return new if len(rs) == 2 and new else None
            new = until(replaced, "a replacement Ready", on_timeout=f.dump)
            back = time.monotonic() - t0
            served_at_replacement = load.count()
            until(lambda: load.count() >= served_at_replacement + 5, "streams after the replacement", on_timeout=f.dump)
        finally:
            load.stop()
        assert load.failures == [], load.failures[:5]
        with pytest.raises(ProcessLookupError):  # the wedged engine is gone, its GPU reused
            os.kill(pid, 0)
        assert new[0]["shards"][0]["pid"] != pid
        # the reason reaches the operator: the API and `llmgw ctl replicas`
        doc = f.replicas()
        lf = next(r for r in doc["replicas"] if r["replica_id"] == new[0]["replica_id"])["last_failure"]
        assert lf["replica_id"] == victim["replica_id"] and "not live: no passing health check" in lf["reason"]
        out = f.ctl("replicas").stdout
        assert f"last failure ({victim['replica_id']}" in out and "health: no answer within 1s" in out, out
        print(f"\nwedged engine: out of Ready {detected:.1f}s after the fault, replacement Ready after {back:.1f}s "
              f"(fail_after {HEALTH['fail_after']}s, interval {HEALTH['interval']}s, timeout {HEALTH['timeout']}s); "
              f"{load.count()} streams served, {len(load.failures)} failed")
