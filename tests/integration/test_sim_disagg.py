"""Prefill/decode disaggregation in the engine simulator, driven as vLLM's toy proxy drives two engines.

Two real simulator processes, one ``kv_producer`` and one ``kv_consumer``: the prefill request
(``do_remote_decode``, ``max_tokens`` 1, not streamed) answers ``kv_transfer_params`` that
``llmgw.kvtransfer`` accepts, the decode request carrying them verbatim gets the same output an
aggregated engine gives, and a pull that cannot succeed (another engine's id, blocks already
taken, a broken side channel) is a 500 under ``kv_load_failure_policy: "fail"`` and a local
prefill under ``"recompute"``, the decoder healthy after each.
"""

from __future__ import annotations

import json
import time

import pytest

from llmgw.kvtransfer import PREFILL_REQUEST, check_prefill_params
from tests.integration.simdisagg import metric, post, xfer_config
from tests.integration.simproc import start_sim
from tests.support.ports import free_port


PROMPT = " ".join(f"w{i}" for i in range(64))  # four 16-token blocks


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    side = free_port()
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side),
           "LLMGW_SIM_PREFILL_TOKEN_LATENCY": "0.001"}
    logs = tmp_path_factory.mktemp("disagg")
    with start_sim(env=env, extra_args=xfer_config("kv_producer"), log_dir=logs) as prefill, \
         start_sim(env={"LLMGW_SIM_PREFILL_TOKEN_LATENCY": "0.001"}, extra_args=xfer_config("kv_consumer", "fail"),
                   log_dir=logs) as decode, \
         start_sim(env={"LLMGW_SIM_PREFILL_TOKEN_LATENCY": "0.001"},
                   extra_args=xfer_config("kv_consumer", "recompute"), log_dir=logs) as recompute:
        yield prefill, decode, recompute


def prefill_once(prefill) -> dict:
    status, doc = post(prefill.url, {"model": "m", "prompt": PROMPT, "max_tokens": 1, "stream": False,
                                     "kv_transfer_params": dict(PREFILL_REQUEST)})
    assert status == 200, doc
    return doc["kv_transfer_params"]


def test_a_remote_prefill_then_decode_gives_the_aggregated_answer_and_pulls_once(pair):
    prefill, decode, _ = pair
    params = prefill_once(prefill)
    assert check_prefill_params(params) == []
    assert len(params["remote_block_ids"][0]) >= 4 and params["remote_num_tokens"] == 64
    status, doc = post(decode.url, {"model": "m", "prompt": PROMPT, "max_tokens": 8, "kv_transfer_params": params})
    assert status == 200, doc
    _, plain = post(decode.url, {"model": "m", "prompt": PROMPT, "max_tokens": 8})
    assert doc["choices"][0]["text"] == plain["choices"][0]["text"] == "tok0 tok1 tok2 tok3 tok4 tok5 tok6 tok7"
    # the blocks were handed over once: a second decode with the same parameters finds nothing
    status, doc = post(decode.url, {"model": "m", "prompt": PROMPT, "max_tokens": 8, "kv_transfer_params": params})
    assert status == 500 and doc["error"]["message"] == "Internal server error"
    assert "expired or taken" in decode.output()
    assert decode.health_status() == 200
    assert metric(decode.url, "vllm:nixl_xfer_time_seconds_count") >= 1
    assert metric(decode.url, "vllm:nixl_num_failed_transfers_total") >= 1


def test_another_engines_id_fails_the_request_not_the_decoder(pair):
    prefill, decode, _ = pair
    params = {**prefill_once(prefill), "remote_engine_id": "00000000-bogus"}
    status, doc = post(decode.url, {"model": "m", "prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": params})
    assert status == 500 and "engine id mismatch" in decode.output()
    assert decode.health_status() == 200
    status, _ = post(decode.url, {"model": "m", "prompt": PROMPT, "max_tokens": 4})
    assert status == 200


def test_recompute_policy_prefills_locally_when_the_pull_fails(pair):
    prefill, _, recompute = pair
    params = {**prefill_once(prefill), "remote_port": free_port()}  # nothing listens there
    before = metric(recompute.url, "vllm:prompt_tokens_total")
    status, doc = post(recompute.url, {"model": "m", "prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": params})
    assert status == 200, doc
    assert doc["choices"][0]["text"] == "tok0 tok1 tok2 tok3"
    assert metric(recompute.url, "vllm:prompt_tokens_total") == before + 64


def test_a_prompt_of_another_length_is_refused(pair):
    prefill, decode, _ = pair
    params = prefill_once(prefill)
    status, doc = post(decode.url, {"model": "m", "prompt": PROMPT + " extra", "max_tokens": 4,
                                    "kv_transfer_params": params})
    assert status == 500 and "this prompt has 65" in decode.output()


def test_a_broken_side_channel_fails_every_pull(tmp_path):
    side = free_port()
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side),
           "LLMGW_SIM_FAULT": "kv-transfer-fail"}
    with start_sim(env=env, extra_args=xfer_config("kv_producer"), log_dir=tmp_path) as prefill, \
         start_sim(extra_args=xfer_config("kv_consumer"), log_dir=tmp_path) as decode:
        params = prefill_once(prefill)
        status, doc = post(decode.url, {"model": "m", "prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": params})
        assert status == 500 and "NIXL transfer failed" in decode.output()
        assert prefill.health_status() == 200 and decode.health_status() == 200


def test_an_unknown_connector_is_refused_at_start(tmp_path):
    from tests.integration.simproc import SimStartError
    bad = ["--kv-transfer-config", json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})]
    with pytest.raises(SimStartError) as e:
        start_sim(extra_args=bad, log_dir=tmp_path, timeout=20)
    assert "the simulator models only NixlConnector" in e.value.output


def test_blocks_no_decoder_pulls_are_freed_after_the_abort_timeout(tmp_path):
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
           "VLLM_NIXL_ABORT_REQUEST_TIMEOUT": "0.5"}
    with start_sim(env=env, extra_args=xfer_config("kv_producer"), log_dir=tmp_path) as prefill, \
         start_sim(extra_args=xfer_config("kv_consumer"), log_dir=tmp_path) as decode:
        params = prefill_once(prefill)
        assert metric(prefill.url, "vllm:kv_cache_usage_perc") > 0  # held for the decoder
        deadline = time.monotonic() + 10
        while metric(prefill.url, "vllm:nixl_num_kv_expired_reqs_total") < 1:
            assert time.monotonic() < deadline, "the held blocks never expired"
            time.sleep(0.1)
        assert metric(prefill.url, "vllm:kv_cache_usage_perc") == 0
        status, doc = post(decode.url, {"model": "m", "prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": params})
        assert status == 500 and "expired or taken" in decode.output()
