"""Prefill/decode interference in real simulator processes: long prompts stall an aggregated engine's
streams and not a decode-only engine's.

Three simulators: an aggregated one, and a ``kv_producer`` / ``kv_consumer`` pair. Each of the
two serving engines streams the same requests while the same long prompts arrive: on the
aggregated engine as plain completions (prefilled there, in chunks of ``--max-num-batched-tokens``),
on the decoder with ``kv_transfer_params`` from the producer (pulled, not prefilled). Both run
at once, so machine load hits both alike; the test compares them, and counts the stalled steps
each engine reports, rather than holding either to a clock.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp

from llmgw.kvtransfer import PREFILL_REQUEST
from tests.integration.simproc import start_sim
from tests.integration.simdisagg import metric, post, xfer_config
from tests.support.ports import free_port



def long_prompt(n: int) -> str:
    """2048 tokens (4 chunks of 512, 0.25 s each), none shared with another prompt's: no prefix hits."""
    return " ".join(f"p{n}x{i}" for i in range(2048))

TIMING = {"LLMGW_SIM_PREFILL_TOKEN_LATENCY": "0.0005", "LLMGW_SIM_TOKEN_LATENCY": "0.01"}
CHUNK = ["--max-num-batched-tokens", "512"]
STREAMS, TOKENS, PROMPTS = 2, 150, 2


async def stream_gaps(session: aiohttp.ClientSession, url: str, i: int, started: asyncio.Event) -> list[float]:
    """Stream one completion; the gaps between its token chunks."""
    body = {"model": "m", "prompt": f"stream {i}", "max_tokens": TOKENS, "stream": True}
    stamps: list[float] = []
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data: {"):
                stamps.append(time.monotonic())
                started.set()
    assert len(stamps) == TOKENS
    return [b - a for a, b in zip(stamps, stamps[1:])]


async def counts(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """The engine's (prefill chunks, decode steps stalled) so far."""
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    found = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name in ("llmgw_sim:prefill_chunks_total", "llmgw_sim:decode_steps_stalled_total"):
            found[name] = float(line.rsplit(" ", 1)[1])
    return found["llmgw_sim:prefill_chunks_total"], found["llmgw_sim:decode_steps_stalled_total"]


async def engine_run(url: str, long_bodies: list[dict]) -> tuple[list[float], float, float]:
    """Streams on ``url``; once all flow, the long prompts arrive. Every stream's gaps, and the
    prefill chunks and stalled decode steps the engine counted from then on."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        started = [asyncio.Event() for _ in range(STREAMS)]
        streams = [asyncio.create_task(stream_gaps(session, url, i, started[i])) for i in range(STREAMS)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
        chunks0, stalled0 = await counts(session, url)
        for body in long_bodies:
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
        gaps = [g for per in await asyncio.gather(*streams) for g in per]
        chunks1, stalled1 = await counts(session, url)
        return gaps, chunks1 - chunks0, stalled1 - stalled0


def test_long_prompts_stall_an_aggregated_engines_streams_not_a_decoders(tmp_path):
    side = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
    with start_sim(env=TIMING, extra_args=CHUNK, log_dir=tmp_path) as agg, \
         start_sim(env={**TIMING, **side}, extra_args=[*CHUNK, *xfer_config("kv_producer")], log_dir=tmp_path) as pre, \
         start_sim(env=TIMING, extra_args=[*CHUNK, *xfer_config("kv_consumer")], log_dir=tmp_path) as dec:
        # the decoder's long prompts are prefilled on the producer first, as a router's first phase does
        to_decoder = []
        for n in range(PROMPTS):
            status, doc = post(pre.url, {"model": "m", "prompt": long_prompt(n), "max_tokens": 1, "stream": False,
                                         "kv_transfer_params": dict(PREFILL_REQUEST)})
            assert status == 200, doc
            to_decoder.append({"model": "m", "prompt": long_prompt(n), "max_tokens": 1,
                               "kv_transfer_params": doc["kv_transfer_params"]})
        plain = [{"model": "m", "prompt": long_prompt(n), "max_tokens": 1} for n in range(PROMPTS)]

        async def both():
            return await asyncio.gather(engine_run(agg.url, plain), engine_run(dec.url, to_decoder))

        (agg_gaps, agg_chunks, agg_stalled), (dec_gaps, dec_chunks, dec_stalled) = asyncio.run(both())

        # the engines' own account: each long prompt took 4 chunks on the aggregated engine, and
        # every chunk stalled both streams; the decoder pulled them and prefilled nothing
        assert (agg_chunks, agg_stalled) == (PROMPTS * 4, PROMPTS * 4 * STREAMS)
        assert (dec_chunks, dec_stalled) == (0, 0)
        assert metric(dec.url, "vllm:nixl_xfer_time_seconds_count") == PROMPTS  # pulled, not prefilled
        assert metric(dec.url, "vllm:nixl_num_failed_transfers_total") == 0
        # and what a client sees: the aggregated streams' worst gap spans a chunk (0.25 s vs 10 ms tokens)
        assert max(agg_gaps) > 3 * max(dec_gaps), (max(agg_gaps), max(dec_gaps))
        assert sum(agg_gaps) > sum(dec_gaps)
