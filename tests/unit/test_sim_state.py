"""The simulator's admission and timing model (llmgw.sim.sim_http.SimState), without HTTP.

Prefill takes LLMGW_SIM_PREFILL_TOKEN_LATENCY per prompt token not found in the prefix cache;
a token takes LLMGW_SIM_TOKEN_LATENCY x (1 + LLMGW_SIM_DECODE_BATCH_SLOWDOWN x (running - 1)).
"""

from __future__ import annotations

import asyncio

import pytest

from llmgw.sim.sim_args import parse_vllm
from llmgw.sim.sim_http import SimState
from llmgw.sim.sim_knobs import Knobs


def state(**knobs) -> SimState:
    cfg = parse_vllm(["m", "--block-size", "8", "--num-gpu-blocks-override", "5"])
    return SimState(cfg, Knobs(**knobs))


def words(n, start=0):
    return [f"w{i}" for i in range(start, start + n)]


def test_prefill_time_is_per_uncached_token():
    async def go():
        s = state(prefill_token_latency=1e-5)
        async with s.run([words(17)], 1) as first:
            pass
        async with s.run([words(17)], 1) as again:  # 16 of 17 tokens cached: one left to compute
            pass
        return first, again
    first, again = asyncio.run(go())
    assert (first.cached, again.cached) == (0, 16)
    assert first.prefill_s == pytest.approx(17e-5) and again.prefill_s == pytest.approx(1e-5)


def test_decoding_slows_as_the_batch_grows():
    async def go():
        s = state(token_latency=0.01, decode_batch_slowdown=0.5)
        alone = s.token_latency()
        async with s.run([words(2)], 1):
            async with s.run([words(2, 10)], 1):
                async with s.run([words(2, 20)], 1):
                    three = s.token_latency()
        return alone, three
    alone, three = asyncio.run(go())
    assert alone == pytest.approx(0.01) and three == pytest.approx(0.01 * (1 + 0.5 * 2))


def test_a_request_waits_for_blocks_first_come_first_served_and_a_cancelled_one_frees_its_place():
    async def go():
        s = state()  # 4 usable blocks of 8 tokens
        order = []

        async def req(name, prompt, n, hold):
            async with s.run([prompt], n):
                order.append(name)
                await hold.wait()

        hold_a, hold_b, hold_c = asyncio.Event(), asyncio.Event(), asyncio.Event()
        a = asyncio.create_task(req("a", words(16), 17, hold_a))  # 32 tokens of KV: the whole cache
        await asyncio.sleep(0)
        b = asyncio.create_task(req("b", words(8, 50), 1, hold_b))
        c = asyncio.create_task(req("c", words(8, 60), 1, hold_c))
        gone = asyncio.create_task(req("gone", words(8, 70), 1, asyncio.Event()))
        for _ in range(5):
            await asyncio.sleep(0)
        assert (order, s.waiting, s.kv.usage()) == (["a"], 3, 1.0)
        gone.cancel()
        for _ in range(5):
            await asyncio.sleep(0)
        assert s.waiting == 2
        hold_a.set()
        await a
        for _ in range(5):
            await asyncio.sleep(0)
        assert order == ["a", "b", "c"] and s.waiting == 0
        hold_b.set(), hold_c.set()
        await asyncio.gather(b, c)
        assert s.kv.usage() == 0.0 and s.running == 0
    asyncio.run(go())
