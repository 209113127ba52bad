"""Autoscaling through real processes: the control plane with its router, two agents, engine simulators.

One replica of ``tiny`` on two one-GPU nodes, autoscaled 1..2 on the
router's requests in flight (target one per replica).  Four streaming
clients make the count go to 2 (placed like any replica); the explain API
(``ctl explain``) and ``/metrics`` say why.  With one client left the count goes back to 1:
the surplus replica leaves the router and finishes its streams before its
engine stops, and no request fails on the way up or down.
"""

from __future__ import annotations

import time

import pytest

from fleet import Fleet, metric_samples, router_endpoints, standalone_router, until
from openai_load import OpenAIStreams

pytestmark = pytest.mark.integration

# 30 tokens at 20 ms: a stream lasts about 0.6 s, so four clients keep about four in flight; an engine
# loads for a second before it serves (a replica's start, which the autoscaler measures as its lead time)
PROFILE = {"env": {"LLMGW_SIM_TOKEN_LATENCY": "0.02", "LLMGW_SIM_STARTUP_DELAY": "1"}}
AUTOSCALE = {"min": 1, "max": 2, "target": 1, "stable_window": 2, "panic_window": 1,
             "scale_down_cooldown": 2, "max_step": 1}


def start_autoscaled(f: Fleet, policy: dict) -> None:
    """Declare ``policy`` on the fleet's one deployment, start it, and wait for its first replica."""
    f.config["deployments"][0]["autoscale"] = policy
    f.write_config()
    f.start()
    f.wait_ready(1)


def desired(f: Fleet) -> dict[str, float]:
    """llmgw_autoscale_desired_replicas by reason, from one scrape."""
    return {lab["reason"]: v for lab, v in metric_samples(f).get("llmgw_autoscale_desired_replicas", [])}


def test_scale_up_under_load_and_down_when_idle_without_a_failed_request(tmp_path):
    with Fleet(tmp_path, nodes={"a": 1, "b": 1}, replicas=1, router=True, profile=PROFILE,
               lifecycle={"startup_grace": 1.0}) as f:
        f.config["deployments"][0]["autoscale"] = AUTOSCALE
        f.write_config()
        f.start()
        (first,) = f.wait_ready(1)
        busy = OpenAIStreams(f.router_url, verify=f.router_verify(), threads=4, max_tokens=30).start()
        quiet = None
        try:
            two = f.wait_ready(2)
            assert first["replica_id"] in {r["replica_id"] for r in two}
            (why,) = f.get("/v1/explain/tiny")["autoscale"]  # what `ctl explain tiny` prints first
            assert (why["deployment"], why["desired"]) == ("tiny/sim", 2), why
            assert why["text"].startswith("autoscale 1..2: 2 replica(s)") and "target 1 per replica" in why["text"]
            got = desired(f)
            assert sum(got.values()) == 2 and set(got) <= {"panic", "stable", "max", "step", "cooldown"}, got
            assert any(lab == {"model": "tiny", "profile": "sim", "window": "stable"}
                       for lab, _ in metric_samples(f)["llmgw_autoscale_signal"])
            # the replicas this control plane placed took their load and first answer to serve: the lead
            # time a rising signal is followed ahead by, measured, not configured
            (lead,) = [v for lab, v in metric_samples(f)["llmgw_autoscale_lead_seconds"]
                       if lab == {"model": "tiny", "profile": "sim"}]
            assert lead >= 1.0
            (dep,) = [d for d in f.get("/v1/catalog")["deployments"] if d["model"] == "tiny"]
            assert dep["scaling"]["lead_s"] >= 1.0

            # one client left: one replica is enough; the other drains while that client streams on
            quiet = OpenAIStreams(f.router_url, verify=f.router_verify(), threads=1, max_tokens=30).start()
            busy.stop()
            served = quiet.count()
            until(lambda: len(f.replicas()["replicas"]) == 1, "the surplus replica to drain and go",
                  on_timeout=f.dump)
            until(lambda: quiet.count() >= served + 3, "streams after the scale-down", on_timeout=f.dump)
        finally:
            busy.stop()
            if quiet is not None:
                quiet.stop()
        assert busy.failures == [] and quiet.failures == [], (busy.failures[:5], quiet.failures[:5])
        assert busy.count() > 0 and quiet.count() > 0
        log = f.server.output(200000)
        assert "draining, scaled down to tiny/sim x1" in log, log[-5000:]
        assert f.wait_ready(1)
        print(f"\nautoscale up and down: {busy.count() + quiet.count()} streams served, none failed")


def test_a_restarted_control_plane_measures_a_whole_window_before_scaling_down(tmp_path):
    """A control plane that has just started (or taken the lead) has seconds of signal, at first one
    instant that may fall between requests: it keeps the replicas that run until it has measured a
    whole stable window, and only then scales down. Before, its first sample after the startup grace
    (nothing in flight at that instant) drained the second replica at once."""
    policy = {**AUTOSCALE, "stable_window": 8}
    with Fleet(tmp_path, nodes={"a": 1, "b": 1}, replicas=1, router=True, profile=PROFILE,
               lifecycle={"startup_grace": 1.0}) as f:
        start_autoscaled(f, policy)
        busy = OpenAIStreams(f.router_url, verify=f.router_verify(), threads=4, max_tokens=30).start()
        try:
            two = {r["replica_id"] for r in f.wait_ready(2)}
        finally:
            busy.stop()
        assert busy.failures == [], busy.failures[:5]
        f.server.kill()  # before its own stable average of the busy minutes falls
        f.server.start()
        f.wait_healthy()

        def measuring() -> bool:
            why = (f.try_get("/v1/explain/tiny") or {}).get("autoscale") or [{}]
            return "(measuring)" in why[0].get("text", "")

        until(measuring, "the restarted control plane to hold its count while it measures", on_timeout=f.dump)
        assert {r["replica_id"] for r in f.ready_replicas()} == two
        assert "scaled down" not in f.server.life_output()
        # a whole window of nothing in flight later, it scales down as ever
        until(lambda: len(f.replicas()["replicas"]) == 1, "the scale-down after a whole window", on_timeout=f.dump)


def test_clients_behind_a_standalone_router_scale_the_deployment_and_its_silence_holds_the_count(tmp_path):
    """No in-process router: every request goes through a standalone ``llmgw router``, whose workers report
    their load (``POST /v1/router/load``). Before, the control plane saw nothing in flight and a busy
    deployment never grew. Then the router is killed under load: its reports stop, and the count holds
    rather than read the silence as idle."""
    with Fleet(tmp_path, nodes={"a": 1, "b": 1}, replicas=1, profile=PROFILE,
               lifecycle={"startup_grace": 1.0}) as f:
        f.config["deployments"][0]["autoscale"] = AUTOSCALE
        f.write_config()
        f.start()
        f.wait_ready(1)
        router, port = standalone_router(f)
        until(lambda: router_endpoints(port) == 1, "the router to see the replica", on_timeout=router.output)
        busy = OpenAIStreams(f"http://127.0.0.1:{port}", threads=4, max_tokens=30).start()
        try:
            f.wait_ready(2)
            (why,) = f.get("/v1/explain/tiny")["autoscale"]
            assert why["desired"] == 2, why
            router.kill()  # mid-load: its workers' reports stop
            until(lambda: "stopped reporting their load" in f.server.output(200000),
                  "the control plane to notice the silent router", on_timeout=f.dump)
            # longer than the stable window and the cooldown: an idle signal would have drained one by now
            seen = f.server.output(200000).count("scaled down to tiny/sim x1")
            until(lambda: len(f.ready_replicas()) == 2 and desired(f) and sum(desired(f).values()) == 2,
                  "the count to hold", timeout=10)
            time.sleep(AUTOSCALE["stable_window"] + AUTOSCALE["scale_down_cooldown"] + 2)
            assert sum(desired(f).values()) == 2
            assert f.server.output(200000).count("scaled down to tiny/sim x1") == seen
        finally:
            busy.stop()
        assert busy.count() > 0


def test_a_scale_up_waits_for_the_replicas_it_asked_for_before_asking_again(tmp_path):
    """``max_scale_up_rate: 2``: six clients want three replicas at once, but while only one serves the
    count is held at two (reason ``rate``): the requests queued while a replica loads are not more
    demand. Once the second serves, the third is placed. Before the cap the count jumped to max at
    once, and a slow start let it climb on its own queue."""
    profile = {"env": {**PROFILE["env"], "LLMGW_SIM_STARTUP_DELAY": "3"}}
    policy = {**AUTOSCALE, "max": 3, "max_step": 4, "max_scale_up_rate": 2, "headroom": 1,
              "scale_down_stabilization": 30}
    with Fleet(tmp_path, nodes={"a": 1, "b": 1, "c": 1}, replicas=1, router=True, profile=profile,
               lifecycle={"startup_grace": 1.0}) as f:
        start_autoscaled(f, policy)
        busy = OpenAIStreams(f.router_url, verify=f.router_verify(), threads=6, max_tokens=30).start()
        held = []
        try:
            def rate_held() -> bool:
                why = ((f.try_get("/v1/explain/tiny") or {}).get("autoscale") or [{}])[0]
                if "(rate" in why.get("text", ""):
                    held.append(why)
                return bool(held)

            until(rate_held, "the scale-up to be held at twice the serving replicas", on_timeout=f.dump)
            assert held[0]["desired"] == 2, held[0]
            assert "plus 1 x sqrt(in flight) spare" in held[0]["text"], held[0]
            assert f.wait_ready(3)
            (dep,) = [d for d in f.get("/v1/catalog")["deployments"] if d["model"] == "tiny"]
            assert {k: dep["autoscale"][k] for k in ("headroom", "max_scale_up_rate", "scale_down_stabilization")} \
                == {"headroom": 1, "max_scale_up_rate": 2, "scale_down_stabilization": 30}, dep["autoscale"]
        finally:
            busy.stop()
        assert busy.failures == [], busy.failures[:5]
        assert busy.count() > 0
