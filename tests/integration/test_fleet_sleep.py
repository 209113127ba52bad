"""Scale to sleep through real processes: the control plane with its router, an agent, engine simulators.

A deployment with ``autoscale.sleep`` has its replicas launched in vLLM's
sleep mode (the simulator plays vLLM: ``--enable-sleep-mode`` and
``VLLM_SERVER_DEV_MODE=1`` attach ``/sleep``, ``/wake_up`` and
``/is_sleeping``), while the router never forwards those routes: a client
that asks the router for them gets the router's own 404 and the engine
stays awake.
"""

from __future__ import annotations

import httpx
import pytest

from fleet import Fleet

pytestmark = pytest.mark.integration

AUTOSCALE = {"min": 1, "max": 1, "sleep": {"after": 600}}
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
