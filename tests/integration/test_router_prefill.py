"""Two-phase serving of a disaggregated model through a real router, with the official ``openai`` client.

Static endpoints of roles prefill and decode on real simulator processes, each one side of vLLM's
NixlConnector (``--kv-transfer-config``, sim_disagg): the router prefills remotely, the decoder pulls
the blocks, and the client gets what an aggregated engine answers; a dead prefill engine, a prefill
whose blocks cannot be pulled, and a short prompt all end in a served request, never an error.
"""

from __future__ import annotations

import json

import pytest

from simproc import start_sim
from tests.integration.router_support import RouterProcess, openai_client, router_doc
from tests.support.ports import free_port

LONG = " ".join(f"w{i}" for i in range(600))  # a body well over min_prompt_bytes
EXPECTED = "tok0 tok1 tok2 tok3 tok4 tok5"


def xfer(role: str, policy: str) -> list[str]:
    return ["--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": role,
                                                "kv_buffer_device": "cpu", "kv_load_failure_policy": policy})]


def metric(sim, name: str) -> float:
    import urllib.request
    with urllib.request.urlopen(f"{sim.url}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd")
    side_ok, side_bad = free_port(), free_port()
    with start_sim(env={"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_ok)},
                   extra_args=xfer("kv_producer", "fail"), log_dir=logs) as prefill, \
         start_sim(env={"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_bad),
                        "LLMGW_SIM_FAULT": "kv-transfer-fail"},
                   extra_args=xfer("kv_producer", "fail"), log_dir=logs) as broken_prefill, \
         start_sim(extra_args=xfer("kv_consumer", "fail"), log_dir=logs) as decode:
        yield prefill, broken_prefill, decode, logs


def router_for(endpoints, logs, **settings):
    return RouterProcess(router_doc(endpoints, disaggregation={"min_prompt_bytes": 1024, **settings}), tmp=logs)


def test_a_long_prompt_is_prefilled_remotely_and_decoded_with_the_aggregated_answer(fleet):
    prefill, _, decode, logs = fleet
    eps = [{"id": "p", "model": "m", "url": prefill.url, "role": "prefill"},
           {"id": "d", "model": "m", "url": decode.url, "role": "decode"}]
    with router_for(eps, logs) as router:
        client = openai_client(router)
        before = metric(decode, "vllm:nixl_xfer_time_seconds_count")
        got = client.completions.create(model="m", prompt=LONG, max_tokens=6)
        assert got.choices[0].text == EXPECTED
        chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": LONG}], max_tokens=6,
                                              stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == EXPECTED
        assert metric(decode, "vllm:nixl_xfer_time_seconds_count") == before + 2  # both pulled their blocks
        assert router.metric("llmgw_router_prefill_total", model="m", outcome="ok") == 2
        # a short prompt is not worth a transfer: the decoder computes it
        assert client.completions.create(model="m", prompt="hi", max_tokens=6).choices[0].text == EXPECTED
        assert metric(decode, "vllm:nixl_xfer_time_seconds_count") == before + 2
        # without a route-key index nothing counts as cached: the rule is prompt length alone
        assert {d: router.metric("llmgw_router_prefill_decisions_total", model="m", decision=d)
                for d in ("remote", "short", "cached")} == {"remote": 2, "short": 1, "cached": 0}


def test_a_dead_prefill_engine_costs_the_client_nothing(fleet):
    prefill, _, decode, logs = fleet
    eps = [{"id": "p-dead", "model": "m", "url": f"http://127.0.0.1:{free_port()}", "role": "prefill"},
           {"id": "p", "model": "m", "url": prefill.url, "role": "prefill"},
           {"id": "d", "model": "m", "url": decode.url, "role": "decode"}]
    with router_for(eps, logs) as router:
        client = openai_client(router)
        for _ in range(4):
            assert client.completions.create(model="m", prompt=LONG, max_tokens=6).choices[0].text == EXPECTED
        assert router.metric("llmgw_router_prefill_total", model="m", outcome="ok") == 4


def test_no_prefill_engine_at_all_falls_back_to_the_decoder(fleet):
    _, _, decode, logs = fleet
    eps = [{"id": "p-dead", "model": "m", "url": f"http://127.0.0.1:{free_port()}", "role": "prefill"},
           {"id": "d", "model": "m", "url": decode.url, "role": "decode"}]
    with router_for(eps, logs) as router:
        client = openai_client(router)
        assert client.completions.create(model="m", prompt=LONG, max_tokens=6).choices[0].text == EXPECTED
        assert router.metric("llmgw_router_prefill_total", model="m", outcome="fallback") == 1


def test_blocks_the_decoder_cannot_pull_end_in_a_local_prefill_not_an_error(fleet):
    _, broken_prefill, decode, logs = fleet
    eps = [{"id": "p-broken", "model": "m", "url": broken_prefill.url, "role": "prefill"},
           {"id": "d", "model": "m", "url": decode.url, "role": "decode"}]
    with router_for(eps, logs) as router:
        client = openai_client(router)
        failed = metric(decode, "vllm:nixl_num_failed_transfers_total")
        assert client.completions.create(model="m", prompt=LONG, max_tokens=6).choices[0].text == EXPECTED
        assert metric(decode, "vllm:nixl_num_failed_transfers_total") == failed + 1  # the pull did fail
        assert decode.health_status() == 200


def test_a_clients_own_transfer_parameters_are_refused_before_any_engine_sees_them(fleet):
    """Parameters naming another engine's blocks would have the decoder pull them (another tenant's
    prompt, or an address of the client's choosing), and a prefill engine hold blocks for nobody."""
    import openai
    prefill, _, decode, logs = fleet
    eps = [{"id": "p", "model": "m", "url": prefill.url, "role": "prefill"},
           {"id": "d", "model": "m", "url": decode.url, "role": "decode"}]
    foreign = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "someone-elses",
               "remote_block_ids": [0, 1, 2], "remote_host": "127.0.0.1", "remote_port": free_port(), "tp_size": 1}
    with router_for(eps, logs) as router:
        client = openai_client(router)
        before = [metric(e, "vllm:prompt_tokens_total") for e in (prefill, decode)]
        for extra in ({"kv_transfer_params": foreign}, {"kv_transfer_params": {"do_remote_decode": True}},
                      {"bootstrap_host": "127.0.0.1", "bootstrap_room": 7}):
            with pytest.raises(openai.BadRequestError) as e:
                client.completions.create(model="m", prompt=LONG, max_tokens=6, extra_body=extra)
            assert e.value.status_code == 400 and e.value.body["param"] == next(iter(extra))
            assert e.value.body["code"] == "unsupported_parameter"
        assert [metric(e, "vllm:prompt_tokens_total") for e in (prefill, decode)] == before
        # the same request without them is served in two phases as ever
        assert client.completions.create(model="m", prompt=LONG, max_tokens=6).choices[0].text == EXPECTED


def test_a_role_the_router_does_not_know_is_refused_naming_the_key(tmp_path):
    import subprocess
    import sys
    import yaml
    cfg = tmp_path / "router.yaml"
    cfg.write_text(yaml.safe_dump({"listen": {"host": "127.0.0.1", "port": 0}, **router_doc(
        [{"model": "m", "url": "http://127.0.0.1:1", "role": "encode"}])}))
    run = subprocess.run([sys.executable, "-m", "llmgw", "config", "validate", "--kind", "router", str(cfg)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "/static_endpoints/0/role" in run.stderr
