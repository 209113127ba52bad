"""Scale to sleep through real processes: the control plane with its router, an agent, engine simulators.

A deployment with ``autoscale.sleep`` has its replicas launched in vLLM's
sleep mode (the simulator plays vLLM: ``--enable-sleep-mode`` and
``VLLM_SERVER_DEV_MODE=1`` attach ``/sleep``, ``/wake_up`` and
``/is_sleeping``), while the router never forwards those routes: a client
that asks the router for them gets the router's own 404 and the engine
stays awake.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from fleet import Fleet, router_endpoints, standalone_router, stream_first_token, until
from tests.support import procfs

pytestmark = pytest.mark.integration

AUTOSCALE = {"min": 1, "max": 1, "sleep": {"after": 600}}
WAKE_TIME = 0.3  # s: the simulator's wake from a level-1 sleep (its default)
BURST = 8
DEV_ROUTES = [("POST", "/sleep?level=1"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
              ("POST", "/collective_rpc"), ("POST", "/reset_prefix_cache")]


def is_sleeping(engine: str) -> bool:
    r = httpx.get(f"{engine}/is_sleeping", timeout=30)
    assert r.status_code == 200, (r.status_code, r.text)  # 404 without dev mode
    return r.json()["is_sleeping"]


def test_sleep_mode_is_launched_but_the_router_never_forwards_dev_routes(tmp_path):
    with Fleet(tmp_path, nodes={"a": 1}, replicas=1, router=True, lifecycle={"startup_grace": 1.0}) as f:
        f.config["deployments"][0]["autoscale"] = AUTOSCALE
        f.write_config()
        f.start()
        (replica,) = f.wait_ready(1)
        engine = replica["endpoint"]
        assert is_sleeping(engine) is False  # the engine runs in sleep mode, awake
        with httpx.Client(base_url=f.router_url, verify=f.router_verify(), timeout=30) as router:
            for method, path in DEV_ROUTES:
                r = router.request(method, path, json={})
                assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url", (path, r.text)
            assert is_sleeping(engine) is False
            r = router.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200, r.text


def test_dev_mode_in_the_agents_own_environment_never_reaches_an_engine(tmp_path, monkeypatch):
    """VLLM_SERVER_DEV_MODE is the adapter's to set (only for a sleep-mode deployment): set in the
    agent's unit or shell it reached every engine the agent started, opening vLLM's unauthenticated
    dev routes (/sleep, /collective_rpc, ...) on a replica that never asked for them."""
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")  # the fleet's processes inherit it, the agent included
    monkeypatch.setenv("VLLM_API_KEY", "a-key-of-the-agents-environment")  # owned too: the replica's key only
    with Fleet(tmp_path, nodes={"a": 1}, replicas=1, router=True, lifecycle={"startup_grace": 1.0}) as f:
        f.start()
        (replica,) = f.wait_ready(1)
        engine = replica["endpoint"]
        (pid,) = [s["pid"] for s in replica["shards"]]
        environ = procfs.environ(pid)
        assert environ is not None
        assert "VLLM_SERVER_DEV_MODE" not in environ, sorted(environ)
        assert environ.get("VLLM_API_KEY") != "a-key-of-the-agents-environment"  # the replica's own key, or none
        for method, path in DEV_ROUTES:
            assert httpx.request(method, f"{engine}{path}", json={}, timeout=30).status_code == 404, path
        r = httpx.post(f"{f.router_url}/v1/completions", verify=f.router_verify(), timeout=30,
                       json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text


def start_asleep(f: Fleet, autoscale: dict, hold: dict) -> str:
    """Declare ``autoscale`` and the router's ``hold``, start the fleet, and wait until its one engine
    sleeps and the control plane knows; the engine's address."""
    f.config["deployments"][0]["autoscale"] = autoscale
    f.config["router"]["hold"] = hold
    f.write_config()
    f.start()
    (replica,) = f.wait_ready(1)
    engine = replica["endpoint"]
    until(lambda: is_sleeping(engine), "the idle engine to be put to sleep", on_timeout=f.dump)
    until(lambda: "ready, asleep" in f.server.output(200000), "the control plane to hear it sleeps",
          on_timeout=f.dump)
    return engine


def test_an_idle_replica_sleeps_and_a_burst_is_held_through_its_wake_and_all_answered(tmp_path):
    profile = {"env": {"LLMGW_SIM_WAKE_TIME": str(WAKE_TIME)}}
    with Fleet(tmp_path, nodes={"a": 1}, replicas=1, router=True, profile=profile,
               lifecycle={"startup_grace": 1.0}) as f:
        engine = start_asleep(f, {"min": 1, "max": 1, "sleep": {"after": 2}}, {"max_requests": 16, "deadline": 30})
        client = f.openai_client()
        with ThreadPoolExecutor(BURST) as pool:
            results = list(pool.map(lambda _: stream_first_token(client), range(BURST)))
        assert len(results) == BURST and all(text for _, _, text in results), results
        assert is_sleeping(engine) is False
        log = f.agents["a"].output(200000)
        assert "engine asleep" in log and "engine awake" in log, log[-3000:]
        firsts = sorted(first for first, _, _ in results)
        print(f"\nwake to first token of a held request (simulator wake {WAKE_TIME} s): "
              f"first {firsts[0]:.2f} s, slowest {firsts[-1]:.2f} s of {BURST}")
        # idle again: it sleeps again, and one more request is held and answered again
        until(lambda: is_sleeping(engine), "the engine to sleep again", on_timeout=f.dump)
        assert stream_first_token(client)[2]


def test_requests_held_for_a_wake_count_as_demand_and_raise_the_count_before_it_ends(tmp_path):
    """A burst against a sleeping model is demand while it waits: the held requests are in the router's
    load, so the autoscaler asks for a second replica during a slow wake. Before, they reached the
    signal only once they ran, and short requests that ran after the wake never raised the count."""
    profile = {"env": {"LLMGW_SIM_WAKE_TIME": "6"}}
    with Fleet(tmp_path, nodes={"a": 1, "b": 1}, replicas=1, router=True, profile=profile,
               lifecycle={"startup_grace": 1.0}) as f:
        engine = start_asleep(f, {"min": 1, "max": 2, "target": 1, "stable_window": 2, "panic_window": 1,
                                  "scale_down_cooldown": 600, "sleep": {"after": 1}},
                              {"max_requests": 16, "deadline": 60})
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        with httpx.Client(base_url=f.router_url, verify=f.router_verify(), timeout=60) as router, \
                ThreadPoolExecutor(4) as pool:
            burst = [pool.submit(router.post, "/v1/completions", json=body) for _ in range(4)]

            def second_asked_for() -> bool:
                why = ((f.try_get("/v1/explain/tiny") or {}).get("autoscale") or [{}])[0]
                return why.get("desired") == 2

            until(second_asked_for, "the held burst to raise the count", timeout=5, on_timeout=f.dump)
            assert not any(r.done() for r in burst) and is_sleeping(engine)  # still held: the wake takes 6 s
            assert all(r.result().status_code == 200 for r in burst), [r.result().text for r in burst]
        assert f.wait_ready(2)


def test_past_the_hold_queue_bound_a_request_gets_503_with_retry_after_and_the_held_one_is_served(tmp_path):
    profile = {"env": {"LLMGW_SIM_WAKE_TIME": "2"}}
    with Fleet(tmp_path, nodes={"a": 1}, replicas=1, router=True, profile=profile,
               lifecycle={"startup_grace": 1.0}) as f:
        start_asleep(f, {"min": 1, "max": 1, "sleep": {"after": 1}}, {"max_requests": 1, "deadline": 30})
        with httpx.Client(base_url=f.router_url, verify=f.router_verify(), timeout=60) as router:
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
            with ThreadPoolExecutor(1) as pool:
                held = pool.submit(router.post, "/v1/completions", json=body)
                until(lambda: "asking a-" in f.server.output(200000) and "to wake" in f.server.output(200000),
                      "the held request's wake to be asked for", on_timeout=f.dump)  # the wake takes 2 s
                refused = router.post("/v1/completions", json=body)
                assert refused.status_code == 503, refused.text
                assert refused.json()["error"]["code"] == "model_waking" and int(refused.headers["Retry-After"]) >= 1
                assert held.result().status_code == 200, held.result().text


def test_a_standalone_router_asks_the_control_plane_for_the_wake_with_its_certificate(tmp_path):
    with Fleet(tmp_path, nodes={"a": 1}, replicas=1, router=True, lifecycle={"startup_grace": 1.0}) as f:
        f.config["deployments"][0]["autoscale"] = {"min": 1, "max": 1, "sleep": {"after": 1}}
        f.write_config()
        f.start()
        (replica,) = f.wait_ready(1)
        router, port = standalone_router(f)
        until(lambda: router_endpoints(port), "the standalone router to learn the endpoint", on_timeout=router.output)
        until(lambda: is_sleeping(replica["endpoint"]), "the idle engine to sleep", on_timeout=f.dump)
        until(lambda: "(asleep)" in f.server.output(200000), "the watch to say it sleeps", on_timeout=f.dump)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["choices"], r.text
        assert "holds requests for tiny: waking it" in f.server.output(200000)  # named by its certificate
        # anything but a router certificate is refused; a malformed body changes nothing
        with f.client() as admin:
            assert admin.post("/v1/router/wake", json={"model": "tiny"}).status_code == 403
        with f.client(cert=f.pki.router) as as_router:
            bad = as_router.post("/v1/router/wake", json={"model": ""})
            assert bad.status_code == 400 and bad.json()["errors"][0]["pointer"] == "/model", bad.text
            assert as_router.post("/v1/router/wake", json={"model": "other"}).json() == {"waking": False}


def test_after_the_agent_and_the_control_plane_restart_a_sleeping_engine_is_still_known_asleep(tmp_path):
    with Fleet(tmp_path, nodes={"a": 1}, replicas=1, router=True, lifecycle={"startup_grace": 1.0}) as f:
        f.config["deployments"][0]["autoscale"] = {"min": 1, "max": 1, "sleep": {"after": 3}}
        f.write_config()
        f.start()
        (replica,) = f.wait_ready(1)
        until(lambda: is_sleeping(replica["endpoint"]), "the idle engine to sleep", on_timeout=f.dump)
        f.agents["a"].kill()
        f.server.kill()
        f.server.start()
        f.wait_healthy()
        f.agents["a"].start()  # adopts the engine, which sleeps on; only the engine knows
        until(lambda: "ready, asleep" in f.server.life_output() and "(asleep)" in f.server.life_output(),
              "the restarted control plane to learn the engine sleeps", on_timeout=f.dump)
        # learnt from the agent, not by putting it to sleep again (which waits for a whole idle time,
        # during which the routers would have sent requests to a sleeping engine)
        assert "to sleep its engine" not in f.server.life_output(), f.server.life_output()[-3000:]
        assert "engine asleep (asked after connecting)" in f.agents["a"].life_output()
        with httpx.Client(base_url=f.router_url, verify=f.router_verify(), timeout=60) as router:
            r = router.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["choices"], r.text  # held, woken, answered
        assert is_sleeping(replica["endpoint"]) is False
