"""The parity check through real processes: a router given a model tokenizer for a model whose
engine does not tokenize like it turns precise routing off for that model, and says so.

The engine simulator has no ``/tokenize`` (it answers 404, as an engine without vLLM's endpoint
would), so a ``llmgw router`` told that the simulator's model is tokenized by a tokenizer.json
cannot prove its ids are the engine's: on the first replica it sees, it logs the reason once,
sets ``llmgw_router_cache_aware_parity{model}`` to 0, shows the reason in ``/healthz``, and routes
the model by prefix affinity; requests keep being served. (Equality with a real engine is
tests/integration/test_vllm_kv_events.py's.)
"""

from __future__ import annotations

import re

import httpx
import pytest

from fleet import Fleet, router_endpoints, standalone_router
from tests.support.polling import until
from tests.support.tinytokenizer import model_dir

pytestmark = pytest.mark.integration


def health(port: int) -> dict:
    return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=30).json()


def test_a_model_whose_engine_cannot_confirm_the_routers_ids_falls_back_and_says_why(tmp_path):
    tok = model_dir(tmp_path)
    with Fleet(tmp_path, nodes={"a": 1}, replicas=1, profile={"kv_events": True}) as f:
        f.start()
        (replica,) = f.wait_ready(1)
        router, port = standalone_router(f, extra={"balancing": {"cache_aware": {
            "models": ["tiny"], "model_tokenizers": {"tiny": str(tok)}, "parity_timeout": 5}}})
        until(lambda: router_endpoints(port) == 1, "the router to see the replica", on_timeout=router.output)
        verdict = until(lambda: (health(port).get("tokenizer_parity", {}).get("tiny", {}).get("parity")
                                 not in (None, "unchecked")) and health(port)["tokenizer_parity"]["tiny"],
                        "the parity verdict", on_timeout=router.output)
        assert verdict["parity"] == "mismatch", verdict
        assert "no usable /tokenize" in verdict["reason"] and replica["replica_id"] in verdict["reason"]
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        assert re.search(r'^llmgw_router_cache_aware_parity\{model="tiny"\} 0\.0$', metrics, re.M), metrics

        for prompt in ("hi there", None):
            body = {"model": "tiny", "max_tokens": 1}
            body.update({"prompt": prompt} if prompt else {"messages": [{"role": "user", "content": "hi there"}]})
            path = "/v1/completions" if prompt else "/v1/chat/completions"
            r = httpx.post(f"http://127.0.0.1:{port}{path}", json=body, timeout=60)
            assert r.status_code == 200, r.text
        log = router.output(10**6)
        assert log.count("cache-aware routing of tiny falls back to prefix affinity") == 1, log

        # the operator's view: the control plane knows the replica feeds route keys, only the router
        # knows it does not route by them; ctl explain says both, and why
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": " ".join(f"w{i}" for i in range(40)), "max_tokens": 1})  # two whole blocks
        assert r.status_code == 200, r.text
        until(lambda: (f.ready_replicas()[0].get("route_keys") or {}).get("keys"), "the replica's route keys",
              timeout=30, on_timeout=f.dump)
        out = f.ctl("explain", "tiny", "--router", f"http://127.0.0.1:{port}").stdout
        assert "cache-aware routing: 1 of 1 running replica(s) feed route keys" in out, out
        (line,) = [ln for ln in out.splitlines() if ln.startswith("router ")]
        assert f"router http://127.0.0.1:{port}: precise routing OFF for tiny" in line, out
        assert verdict["reason"] in line, out
