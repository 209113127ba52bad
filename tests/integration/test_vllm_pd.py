"""Prefill/decode disaggregation on two real vLLM CPU engines over NIXL, routed by llmgw's router.

vLLM 0.32's CPU build with NixlConnector (NIXL's UCX backend over TCP on loopback), one engine
``kv_producer`` and one ``kv_consumer``, behind a real router whose static endpoints carry the
roles (the catalog and placement do not set roles yet). Proves what the simulator cannot: the
parameters the router forwards are the ones a real decoder accepts (it pulls the blocks: a NIXL
transfer is counted), the answer is token for token the decoder's own greedy answer, and killing
the prefill engine costs the client nothing (the decoder prefills). About a minute and a half:
both engines start together.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import urllib.request

import pytest

from realvllm import start_vllm, tiny_hf_model, vllm_python  # noqa: F401 (fixtures)
from tests.integration.router_support import RouterProcess, openai_client, router_doc
from tests.support.polling import until
from tests.support.ports import free_port
from tests.support.procfs import tree_pids

PROMPT = [(7 * i + 3) % 200 + 10 for i in range(100)]  # token ids: three full 32-token blocks and a tail


def nixl_env(side_port: int) -> dict[str, str]:
    return {"UCX_TLS": "tcp,self,sm", "UCX_NET_DEVICES": "lo", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port)}


def xfer(role: str) -> tuple[str, ...]:
    return ("--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": role,
                                                "kv_buffer_device": "cpu", "kv_load_failure_policy": "fail"}))


def counter(eng, name: str) -> float:
    with urllib.request.urlopen(f"{eng.url}/metrics", timeout=10) as r:
        return sum(float(line.rsplit(" ", 1)[1]) for line in r.read().decode().splitlines()
                   if line.startswith(name + "{"))


def direct(eng, max_tokens: int) -> str:
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(f"{eng.url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["text"]


@pytest.fixture(scope="module")
def pair(vllm_python, tiny_hf_model, tmp_path_factory):  # noqa: F811
    work = tmp_path_factory.mktemp("vllm-pd")
    (work / "p").mkdir()
    (work / "d").mkdir()
    engines = [start_vllm(vllm_python, tiny_hf_model, work / name, f"pd-{name}", env=nixl_env(free_port()),
                          wait=False, extra=xfer(role))[0]
               for name, role in (("p", "kv_producer"), ("d", "kv_consumer"))]
    try:
        for eng in engines:
            eng.wait_healthy(600)
        yield engines
    finally:
        for eng in engines:
            eng.stop(timeout=30)


def test_two_real_engines_over_nixl_answer_as_the_decoder_alone_and_survive_a_dead_prefill(pair, tmp_path):
    prefill, decode = pair
    alone = direct(decode, 8)  # the decoder's own greedy answer, prefilled locally
    eps = [{"id": "p", "model": "tiny", "url": prefill.url, "role": "prefill"},
           {"id": "d", "model": "tiny", "url": decode.url, "role": "decode"}]
    with RouterProcess(router_doc(eps, disaggregation={"min_prompt_bytes": 0}), tmp=tmp_path) as router:
        client = openai_client(router)
        pulled = counter(decode, "vllm:nixl_xfer_time_seconds_count")
        got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
        assert got.choices[0].text == alone
        # the blocks crossed over NIXL; vLLM publishes connector stats with a later engine step's
        # output, so the counter may trail the answer
        until(lambda: counter(decode, "vllm:nixl_xfer_time_seconds_count") > pulled, "a NIXL transfer counted", 60)
        assert router.metric("llmgw_router_prefill_total", model="tiny", outcome="ok") == 1
        # the whole engine dies (API server, EngineCore, worker), as on a host that lost it: a
        # SIGKILL of the API server alone leaves its EngineCore running, orphaned
        for pid in sorted(tree_pids(prefill.proc.pid)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        prefill.proc.wait(timeout=30)
        for _ in range(3):  # no prefill engine: the decoder prefills, the client sees nothing
            assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8,
                                             temperature=0).choices[0].text == alone
        assert router.metric("llmgw_router_prefill_total", model="tiny", outcome="ok") == 1
