"""Autoscaling on the engines' own queue depth, through real processes.

A control plane with its router, two agents on their mutual-TLS streams and
engine simulators that run one request at a time (``--max-num-seqs 1``), so
that four streaming clients (the official ``openai`` client) leave requests
waiting in the engine (``vllm:num_requests_waiting``).  The deployment scales
on ``signal: queue_depth``: the control plane asks each agent to read its
engine, the agent reads ``/metrics`` with the engine key and sends what moved,
and the count goes from 1 to 2.  The control plane's view of the signal is in
``/v1/catalog``, ``ctl explain`` and ``/metrics``.

Then the new replica's agent is killed as the load stops (its engine serves
on): its value stops counting, the sample is partial and the count holds past
the stable window and the cooldown, where an idle reading would have drained
a replica.  Restarted, the agent is asked again, reports, and the deployment
scales back to 1.
"""

from __future__ import annotations

import time

import pytest

from fleet import Fleet, metric_samples, until
from openai_load import OpenAIStreams

pytestmark = pytest.mark.integration

PROFILE = {"env": {"LLMGW_SIM_TOKEN_LATENCY": "0.02", "LLMGW_SIM_STARTUP_DELAY": "1"},
           "extra_args": ["--max-num-seqs", "1"]}
AUTOSCALE = {"min": 1, "max": 2, "signal": "queue_depth", "target": 1, "stable_window": 2, "panic_window": 1,
             "scale_down_cooldown": 2, "max_step": 1}


def test_requests_waiting_in_the_engines_scale_the_deployment_up(tmp_path):
    with Fleet(tmp_path, nodes={"a": 1, "b": 1}, replicas=1, router=True, profile=PROFILE,
               lifecycle={"startup_grace": 1.0, "engine_signal_period": 0.5, "lost_after": 120.0}) as f:
        f.config["deployments"][0]["autoscale"] = AUTOSCALE
        f.write_config()
        f.start()
        (first,) = f.wait_ready(1)

        def seen() -> dict:
            (dep,) = [d for d in f.get("/v1/catalog")["deployments"] if d["model"] == "tiny"]
            return dep["scaling"]["engine_signal"] or {}

        # idle: the agent reads its engine and says nothing waits
        until(lambda: seen().get("total") == 0.0 and seen().get("reporting") == 1, "the idle engine's report",
              on_timeout=f.dump)
        busy = OpenAIStreams(f.router_url, verify=f.router_verify(), threads=4, max_tokens=30).start()
        try:
            until(lambda: (seen().get("total") or 0) >= 1, "requests waiting in the engine, as the control plane "
                  "sees them", on_timeout=f.dump)
            two = f.wait_ready(2)
            assert first["replica_id"] in {r["replica_id"] for r in two}
            (why,) = f.get("/v1/explain/tiny")["autoscale"]  # what `ctl explain tiny` prints first
            assert why["desired"] == 2 and "waiting in the engines" in why["text"], why
            assert why["engine_signal"]["signal"] == "queue_depth", why
            shown = why["text"]
            samples = metric_samples(f)
            assert [v for lab, v in samples["llmgw_engine_signal_messages_total"]][0] > 0
            assert sum(v for _, v in samples["llmgw_autoscale_desired_replicas"]) == 2
            # the new replica's agent was asked to read its engine too: both count, and still queue
            until(lambda: seen().get("reporting") == seen().get("replicas") == 2, "both replicas' engines "
                  "reporting", on_timeout=f.dump)
            (second,) = [r for r in two if r["replica_id"] != first["replica_id"]]
            (node,) = [n for n, nid in f.node_ids.items() if nid == second["shards"][0]["node_id"]]
            f.agents[node].kill()  # its engine keeps serving; nobody reads it now
        finally:
            busy.stop()
        assert busy.failures == [], busy.failures[:5]
        assert busy.count() > 0
        until(lambda: seen().get("partial") is True and seen().get("reporting") == 1, "the silent agent's "
              "replica to stop counting", on_timeout=f.dump)
        # longer than the stable window and the cooldown: a reading of nothing waiting would have drained one
        time.sleep(AUTOSCALE["stable_window"] + AUTOSCALE["scale_down_cooldown"] + 2)
        (why,) = f.get("/v1/explain/tiny")["autoscale"]
        assert why["desired"] == 2 and "1 of 2 Ready replica(s) reporting" in why["text"], why
        assert len(f.ready_replicas()) == 2 and "scaled down" not in f.server.output(200000)
        held = why["text"]
        f.agents[node].start()  # adopts its engine, is asked again on its new stream, reports nothing waiting
        until(lambda: len(f.replicas()["replicas"]) == 1, "the scale-down once every engine reports",
              on_timeout=f.dump)
        assert "draining, scaled down to tiny/sim x1" in f.server.output(200000)
        print(f"\nqueue depth scaled 1 -> 2: {busy.count()} streams served, none failed\n{shown}\n{held}")
