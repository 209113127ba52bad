"""The control plane's proof of a prefill/decode pair, against real simulator engines over real sockets.

A healthy pair proves (the decoder counts the pull); a prefill engine whose blocks cannot be pulled, one
that is not a prefill engine at all, and one that is gone each fail the proof with the reason, so the
replica stays out of the routers while its decoder keeps serving.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from simproc import start_sim
from llmgw.controlplane.pairproof import Endpoint, Trial, prove
from tests.support.ports import free_port


def xfer(role: str) -> list[str]:
    return ["--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": role,
                                                "kv_buffer_device": "cpu"})]


def side(port: int, **extra: str) -> dict[str, str]:
    return {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port), **extra}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    logs = tmp_path_factory.mktemp("proof")
    with start_sim(env=side(free_port()), extra_args=xfer("kv_producer"), log_dir=logs) as prefill, \
         start_sim(env=side(free_port(), LLMGW_SIM_FAULT="kv-transfer-fail"), extra_args=xfer("kv_producer"),
                   log_dir=logs) as broken, \
         start_sim(log_dir=logs) as plain, \
         start_sim(env=side(free_port()), extra_args=xfer("kv_consumer"), log_dir=logs) as decode:
        yield prefill, broken, plain, decode


def proof(prefill_url: str, decode_url: str) -> str | None:
    async def main():
        async with aiohttp.ClientSession() as s:
            return await prove(s, Trial("m", Endpoint("p", prefill_url, None), Endpoint("d", decode_url, None)), 20)
    return asyncio.run(main())


def test_a_healthy_pair_proves(engines):
    prefill, _, _, decode = engines
    assert proof(prefill.url, decode.url) is None


def test_blocks_the_decoder_cannot_pull_fail_the_proof(engines):
    _, broken, _, decode = engines
    why = proof(broken.url, decode.url)
    assert why is not None and "failed transfer" in why


def test_an_engine_that_is_no_prefill_side_fails_the_proof(engines):
    _, _, plain, decode = engines
    why = proof(plain.url, decode.url)
    assert why is not None and "cannot go to a decoder" in why


def test_a_dead_prefill_engine_fails_the_proof(engines):
    *_, decode = engines
    why = proof(f"http://127.0.0.1:{free_port()}", decode.url)
    assert why is not None and "Error" in why
