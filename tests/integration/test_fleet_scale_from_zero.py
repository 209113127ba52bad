"""Scale to zero and back through real processes: control plane, its router or a standalone one, an agent,
the engine simulator, the official ``openai`` client.

A deployment with ``autoscale.min: 0`` stops its last engine after a whole
stable window with nothing in flight; the model stays listed, a request for
it is held by the router while the wake it asks for starts a replica, and is
answered by that replica.
"""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from fleet import Fleet, router_endpoints, standalone_router, stream_first_token, until

pytestmark = pytest.mark.integration

AUTOSCALE = {"min": 0, "max": 2, "target": 1, "stable_window": 3, "panic_window": 1, "scale_down_cooldown": 1}
STARTUP = 3.0  # s: the simulator's weight load, so the held requests wait for a real start


def at_zero(f: Fleet, times: int = 1) -> None:
    """Wait until the deployment was scaled to zero ``times`` and has no replica and no engine process."""
    until(lambda: f.server.output(400000).count("-> 0 replica(s)") >= times and not f.replicas()["replicas"]
          and not f.engine_pids(), "the idle deployment to stop its last engine", timeout=60, on_timeout=f.dump)


def test_an_idle_deployment_goes_to_zero_and_a_held_burst_starts_a_replica_that_answers_it(tmp_path):
    profile = {"env": {"LLMGW_SIM_STARTUP_DELAY": str(STARTUP)}}
    with Fleet(tmp_path, nodes={"a": 1, "b": 1}, replicas=1, router=True, profile=profile,
               lifecycle={"startup_grace": 1.0}) as f:
        f.config["deployments"][0]["autoscale"] = AUTOSCALE
        f.config["router"]["hold"] = {"max_requests": 16, "deadline": 60}
        f.write_config()
        f.start()
        at_zero(f)  # (its first replica may not even have loaded: nothing asked for it)
        assert "models that scale from zero: tiny" in f.server.output(200000)
        explain = f.ctl("explain", "tiny").stdout
        assert "autoscale 0..2: 0 replica(s)" in explain and "at zero: the routers hold a request" in explain, explain
        client = f.openai_client(timeout=90)
        assert [m.id for m in client.models.list().data] == ["tiny"]  # still listed at zero
        with pytest.raises(openai.NotFoundError):  # a model nobody declared is still unknown
            client.completions.create(model="other", prompt="hi", max_tokens=1)
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda _: stream_first_token(client), range(4)))
        assert all(text for _, _, text in results), results
        assert f.engine_pids()  # an engine again, started for them
        firsts = sorted(first for first, _, _ in results)
        print(f"\nfrom zero to the first token of a held request (simulator load {STARTUP} s): "
              f"first {firsts[0]:.2f} s, slowest {firsts[-1]:.2f} s of {len(results)}")
        # four held at a target of 1 per replica: the held count is demand, so the count rose to 2
        # while the first replica was still loading (not only once the requests ran on it)
        log = f.server.output(400000)
        woke = log.index("autoscale tiny/sim: 0 -> ")
        assert "autoscale tiny/sim: 1 -> 0 replica(s)" in log[:woke], log[-4000:]
        first_ready = log.index(": ready\n", woke)
        assert "-> 2 replica(s)" in log[woke:first_ready], log[woke:]
        at_zero(f, 2)  # idle again: back to zero


def test_a_standalone_router_holds_a_request_for_a_model_at_zero_and_its_wake_starts_one(tmp_path):
    with Fleet(tmp_path, nodes={"a": 1}, replicas=1, router=True, lifecycle={"startup_grace": 1.0}) as f:
        f.config["deployments"][0]["autoscale"] = AUTOSCALE
        f.write_config()
        f.start()
        f.wait_ready(1)
        router, port = standalone_router(f, extra={"hold": {"max_requests": 4, "deadline": 60}})
        until(lambda: router_endpoints(port), "the standalone router to learn the endpoint", on_timeout=router.output)
        at_zero(f)
        until(lambda: router_endpoints(port) == 0, "the standalone router to see no endpoint", on_timeout=router.output)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=90,
                       json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["choices"], r.text
        assert "holds requests for tiny" in f.server.output(200000)  # asked by its certificate
        with f.client(cert=f.pki.router) as as_router:
            bad = as_router.post("/v1/router/wake", json={"model": "tiny", "held": -1})
            assert bad.status_code == 400 and bad.json()["errors"][0]["pointer"] == "/held", bad.text


def test_a_sleeping_deployment_lends_its_gpu_to_one_that_waits_and_comes_back_from_zero(tmp_path):
    """One GPU, two models: ``tiny`` sleeps and lends (``sleep.lend``); ``other`` waits for a GPU. The lender's
    engine stops and ``other`` is placed on its GPU; a request for ``tiny`` while ``other`` holds it is held,
    ends the loan, and gets 503 ``model_waking`` at the hold deadline; once ``other`` is gone, ``tiny`` starts
    again from zero and answers."""
    with Fleet(tmp_path, nodes={"a": 1}, replicas=1, router=True, lifecycle={"startup_grace": 1.0}) as f:
        f.config["models"].append({"name": "other", "source": "org/other"})
        f.config["deployments"][0]["autoscale"] = {"min": 1, "max": 1, "sleep": {"after": 1, "lend": True}}
        f.config["deployments"].append({"model": "other", "profile": "sim", "replicas": 1})
        f.config["router"]["hold"] = {"max_requests": 4, "deadline": 3}
        f.write_config()
        f.start()
        until(lambda: "tiny/sim: every replica asleep; lending its GPUs to other/sim" in f.server.output(200000),
              "the sleeping deployment to lend its GPU", on_timeout=f.dump)
        until(lambda: [r["model"] for r in f.ready_replicas()] == ["other"], "the borrower to be placed and Ready",
              on_timeout=f.dump)
        explain = f.ctl("explain", "tiny").stdout
        assert "lent: its GPUs went to other/sim" in explain, explain
        with httpx.Client(base_url=f.router_url, verify=f.router_verify(), timeout=30) as router:
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
            r = router.post("/v1/completions", json=body)  # held; the GPU is the borrower's
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_waking", r.text
            assert "tiny/sim: asked for again; its GPUs' loan to other/sim ends" in f.server.output(200000)
            f.config["deployments"].pop()  # the borrower goes: its GPU is free for the lender
            f.write_config()
            f.server.signal(signal.SIGHUP)
            r = router.post("/v1/completions", json=body)  # held while tiny starts again, then answered
            for _ in range(5):  # each try holds up to the deadline: a whole start may take a few
                if r.status_code == 200:
                    break
                assert r.json()["error"]["code"] == "model_waking", r.text
                r = router.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["choices"], r.text
