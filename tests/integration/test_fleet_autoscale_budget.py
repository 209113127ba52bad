"""A fleet GPU budget through real processes: two autoscaled models compete for three GPUs.

One agent with three simulated GPUs, the control plane with its router,
``tiny`` (priority 10) and ``other`` (priority 0), each autoscaled 1..2 on
the router's requests in flight, ``autoscale_budget: {gpus: 3}``.  Load on
``other`` alone: it takes the third GPU.  Load on ``tiny`` too: ``tiny``
wins it, ``other`` is drained back to its grant of 1 (make before break) and
``ctl explain other`` says who holds the GPUs.  The load on ``tiny`` stops:
``tiny`` scales down and ``other`` grows into the freed GPU.  No client
request fails throughout.
"""

from __future__ import annotations

import pytest

from fleet import Fleet, metric_samples, until
from openai_load import OpenAIStreams

pytestmark = pytest.mark.integration

# 30 tokens at 20 ms: a stream lasts about 0.6 s, so three clients keep about three in flight
PROFILE = {"env": {"LLMGW_SIM_TOKEN_LATENCY": "0.02"}}
AUTOSCALE = {"min": 1, "max": 2, "target": 1, "stable_window": 1, "panic_window": 0.5,
             "scale_down_cooldown": 1, "max_step": 1}


def ready_by_model(f: Fleet) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in f.ready_replicas():
        out[r["model"]] = out.get(r["model"], 0) + 1
    return out


def live_by_model(f: Fleet) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in f.replicas()["replicas"]:
        out[r["model"]] = out.get(r["model"], 0) + 1
    return out


def budget_line(f: Fleet, model: str) -> dict:
    (why,) = f.get(f"/v1/explain/{model}")["autoscale"]  # what `ctl explain MODEL` prints first
    return why


def test_the_higher_priority_model_wins_the_gpus_and_the_lower_grows_back_when_they_free(tmp_path):
    with Fleet(tmp_path, nodes={"a": 3}, replicas=1, router=True, profile=PROFILE,
               lifecycle={"startup_grace": 1.0}) as f:
        f.config["models"].append({"name": "other", "source": "org/other"})
        f.config["deployments"] = [
            {"model": "tiny", "profile": "sim", "replicas": 1, "autoscale": {**AUTOSCALE, "priority": 10}},
            {"model": "other", "profile": "sim", "replicas": 1, "autoscale": AUTOSCALE},
        ]
        f.config["autoscale_budget"] = {"gpus": 3}
        f.write_config()
        f.start()
        f.wait_ready(2)
        verify = f.router_verify()
        low = OpenAIStreams(f.router_url, verify=verify, threads=3, model="other", max_tokens=30).start()
        high = None
        try:
            # alone under load, the low-priority model takes the free GPU
            until(lambda: ready_by_model(f) == {"tiny": 1, "other": 2}, "other at 2", on_timeout=f.dump)

            # the high-priority model's load: it wins the GPU, the low one is drained back to 1
            high = OpenAIStreams(f.router_url, verify=verify, threads=3, model="tiny", max_tokens=30).start()
            until(lambda: ready_by_model(f) == {"tiny": 2, "other": 1} and live_by_model(f) == {"tiny": 2, "other": 1},
                  "tiny at 2, other drained to 1", on_timeout=f.dump)
            why = budget_line(f, "other")
            assert why["budget"]["desired"] == 2 and why["budget"]["granted"] == 1, why
            assert why["budget"]["reason"] == "priority", why
            assert "budget 3 GPU(s): granted 1 of 2" in why["text"], why
            assert "priority 10 deployment tiny/sim holds the GPUs" in why["text"], why
            assert budget_line(f, "tiny")["budget"]["granted"] == 2
            printed = f.ctl("explain", "other").stdout
            assert "other/sim: autoscale 1..2" in printed and "tiny/sim holds the GPUs" in printed, printed
            granted = {(lab["model"], lab["reason"]): v
                       for lab, v in metric_samples(f)["llmgw_autoscale_granted_replicas"]}
            assert granted[("other", "priority")] == 1 and granted[("tiny", "full")] == 2, granted
            served = low.count()
            until(lambda: low.count() >= served + 3, "other still served at its grant", on_timeout=f.dump)

            # the high one's load stops: it scales down, the low one grows into the freed GPU
            high.stop()
            until(lambda: ready_by_model(f) == {"tiny": 1, "other": 2} and live_by_model(f) == {"tiny": 1, "other": 2},
                  "other back at 2", on_timeout=f.dump)
            assert budget_line(f, "other")["budget"]["reason"] == "full"
        finally:
            low.stop()
            if high is not None:
                high.stop()
        assert low.failures == [] and high.failures == [], (low.failures[:5], high.failures[:5])
        assert low.count() > 0 and high.count() > 0
        log = f.server.output(400000)
        assert "draining, scaled down to other/sim x1" in log, log[-5000:]
        print(f"\nbudget: {low.count() + high.count()} streams served, none failed; explained: {why['text']}")
