"""The simulator's prefill/decode interference step model (llmgw.sim.sim_interference), on a fake clock.

A prompt's prefill runs in chunks of ``--max-num-batched-tokens``, one prompt at a time, and each
chunk pushes back the next token of every stream decoding on the engine by its length.
"""

from __future__ import annotations

import asyncio

import pytest

from llmgw.sim.sim_args import parse_sglang, parse_vllm
from llmgw.sim.sim_http import SimState
from llmgw.sim.sim_interference import DEFAULT_CHUNK_TOKENS, Interference, chunks
from llmgw.sim.sim_knobs import KnobError, Knobs, knobs_from_env


class FakeClock:
    """Sleeps that advance a counter instead of waiting; the order of wake-ups is kept by asyncio."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)


def test_chunks_cut_a_prompt_by_the_token_budget():
    assert chunks(10_000, 4096) == [4096, 4096, 1808]
    assert chunks(8192, 4096) == [4096, 4096]
    assert chunks(100, 4096) == [100]
    assert chunks(10_000, None) == [10_000]  # chunked prefill off: one step
    assert chunks(0, 4096) == []


def test_each_chunk_is_one_step_of_its_tokens_time():
    clock = FakeClock()
    eng = Interference(0.001, 4096, sleep=clock.sleep)
    asyncio.run(eng.prefill(10_000))
    assert clock.slept == pytest.approx([4.096, 4.096, 1.808])
    assert eng.chunks_run == 3 and eng.stalled_s == pytest.approx(10.0)


def test_a_stream_is_delayed_by_the_prefills_scheduled_while_it_decodes():
    clock = FakeClock()
    eng = Interference(0.001, 4096, sleep=clock.sleep)

    async def go():
        await eng.prefill(1000)  # before the stream: no delay to it
        with eng.decode() as stream, eng.decode():
            assert stream.delay() == 0.0
            await eng.prefill(10_000)
            during = stream.delay()
        await eng.prefill(500)  # after it ended: nothing more counts against it
        return during, stream.delay()

    during, after = asyncio.run(go())
    assert during == pytest.approx(10.0)
    assert after == pytest.approx(10.5)  # the engine's clock moved on, the stream was gone
    # three chunks, each stalling the two requests decoding
    assert eng.steps_stalled == 6


def test_prompts_prefill_one_at_a_time_first_come_first_served():
    clock = FakeClock()
    eng = Interference(0.001, 2048, sleep=clock.sleep)
    done: list[tuple[str, float]] = []

    async def one(name: str, tokens: int) -> None:
        await eng.prefill(tokens)
        done.append((name, clock.now))

    async def go():
        await asyncio.gather(one("a", 4096), one("b", 1000), one("c", 2048))

    asyncio.run(go())
    # b waits for both of a's chunks, c for b: no chunk of one prompt between another's
    assert [n for n, _ in done] == ["a", "b", "c"]
    assert [t for _, t in done] == pytest.approx([4.096, 5.096, 7.144])


def test_switched_off_prefills_overlap_and_stall_nothing():
    clock = FakeClock()
    eng = Interference(0.001, 2048, enabled=False, sleep=clock.sleep)

    async def go():
        with eng.decode() as stream:
            await asyncio.gather(eng.prefill(4096), eng.prefill(4096))
            return stream.delay()

    assert asyncio.run(go()) == 0.0
    assert clock.slept == pytest.approx([4.096, 4.096])  # one sleep each, side by side
    assert eng.chunks_run == 0 and eng.steps_stalled == 0


def test_no_prefill_latency_costs_nothing():
    clock = FakeClock()
    eng = Interference(0.0, 2048, sleep=clock.sleep)
    asyncio.run(eng.prefill(10_000))
    assert clock.slept == [] and eng.chunks_run == 0


def test_the_chunk_comes_from_the_engine_flags():
    assert parse_vllm(["m"]).prefill_chunk_tokens == DEFAULT_CHUNK_TOKENS
    assert parse_vllm(["m", "--max-num-batched-tokens", "2k"]).prefill_chunk_tokens == 2000
    assert parse_vllm(["m", "--no-enable-chunked-prefill"]).prefill_chunk_tokens is None
    assert parse_sglang(["--model-path", "m", "--chunked-prefill-size", "4096"]).prefill_chunk_tokens == 4096
    assert parse_sglang(["--model-path", "m", "--chunked-prefill-size", "-1"]).prefill_chunk_tokens is None


def test_the_switch_is_a_knob():
    assert knobs_from_env({}).prefill_interference is True
    assert knobs_from_env({"LLMGW_SIM_PREFILL_INTERFERENCE": "0"}).prefill_interference is False
    with pytest.raises(KnobError, match="LLMGW_SIM_PREFILL_INTERFERENCE"):
        knobs_from_env({"LLMGW_SIM_PREFILL_INTERFERENCE": "yes"})


def test_the_engine_state_runs_prefills_through_the_lane():
    """SimState.run prefills through its Interference: a second prompt waits for the first."""
    async def go():
        cfg = parse_vllm(["m", "--max-num-batched-tokens", "16"])
        s = SimState(cfg, Knobs(prefill_token_latency=0.002))
        order: list[str] = []

        async def one(name: str, start: int) -> None:
            async with s.run([[f"w{i}" for i in range(start, start + 40)]], 1):
                order.append(name)

        await asyncio.gather(one("a", 0), one("b", 1000))
        return s, order

    s, order = asyncio.run(go())
    assert order == ["a", "b"]
    assert s.interference.chunks_run == 6  # 40 tokens in chunks of 16, twice
    assert b"llmgw_sim:prefill_chunks_total" in s.metrics.render()
