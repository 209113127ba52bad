"""Prefill/decode interference: an engine's prefills delay the decode steps of everything it generates for.

Why: an engine runs one batch per step, and a step that carries a prompt's prefill lasts as
long as that prefill. Every request decoding on the engine waits for the step, so a long prompt
arriving on an aggregated engine stalls the token streams of all the others (inter-token
latency spikes); an engine that only decodes (its prompts prefilled elsewhere and pulled over a
KV transfer, sim_disagg) never carries a prefill and never stalls. That difference is what
disaggregation buys, and a simulator without it could only show disaggregation's cost.

The model, as vLLM's scheduler runs chunked prefill (on by default in vLLM v1):

- A prompt's uncached tokens are prefilled in chunks of at most ``--max-num-batched-tokens``
  (SGLang: ``--chunked-prefill-size``; default 8192, vLLM's default for its API server on
  large GPUs), one chunk per engine step. With ``--no-enable-chunked-prefill`` the whole prompt
  is one step. A chunk of ``c`` tokens lasts ``c x LLMGW_SIM_PREFILL_TOKEN_LATENCY`` seconds.
- One prefill at a time: prompts are prefilled first come, first served, each to its end before
  the next begins (vLLM schedules a partly prefilled request ahead of waiting ones). Concurrent
  prompts on one engine therefore queue, and their time to first token includes the wait.
- Each chunk delays the next decode step of every request decoding on the engine by the chunk's
  length: a stream's token ``i`` is due ``(i + 1) x token latency`` after its first plus the
  prefill seconds the engine scheduled since that stream began. One chunk lengthens one of
  its steps; the tokens after keep their pace.

Simplifications, stated: the token budget a step spends on decode tokens (one per running
request) is not taken out of the chunk, a step does not pack the tail of one prompt with the
head of the next, and a decode step's own time is unchanged by the chunk beside it (the batch
slowdown of sim_timing still applies). Total prefill time is exact; only how it is cut into
steps is approximate.

``LLMGW_SIM_PREFILL_INTERFERENCE=0`` turns the model off: prefills of concurrent prompts run
side by side and never delay decoding (the simulator's behaviour before this model). With
``LLMGW_SIM_PREFILL_TOKEN_LATENCY`` at 0 (the default) nothing here costs anything.

Counted on /metrics (simulator-only names): ``llmgw_sim:prefill_chunks_total`` (engine steps
that carried a prefill chunk) and ``llmgw_sim:decode_steps_stalled_total`` (decode steps those
chunks delayed: the requests decoding when each chunk began).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Awaitable, Callable, Iterator

DEFAULT_CHUNK_TOKENS = 8192


def chunks(tokens: int, chunk_tokens: int | None) -> list[int]:
    """The engine steps a prefill of ``tokens`` takes: their sizes, in order (None: one step)."""
    if tokens <= 0:
        return []
    if chunk_tokens is None or chunk_tokens >= tokens:
        return [tokens]
    full, rest = divmod(tokens, chunk_tokens)
    return [chunk_tokens] * full + ([rest] if rest else [])


class Stream:
    """One request's decode: how much its tokens are pushed back by prefills since it began."""

    __slots__ = ("_engine", "_origin")

    def __init__(self, engine: "Interference") -> None:
        self._engine = engine
        self._origin = engine.stalled_s

    def delay(self) -> float:
        """Seconds of prefill the engine scheduled since this stream began: its tokens' delay."""
        return self._engine.stalled_s - self._origin


class Interference:
    """One engine's prefill lane and the stalls it causes to the streams decoding beside it."""

    def __init__(self, prefill_token_latency: float, chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
                 enabled: bool = True, sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
                 metrics: Any = None) -> None:
        self.prefill_token_latency = prefill_token_latency
        self.chunk_tokens = chunk_tokens
        self.enabled = enabled
        self._sleep = sleep
        self._metrics = metrics  # sim_metrics.InterferenceMetrics, or None
        self._lane = asyncio.Lock()  # FIFO: prompts prefill one at a time, first come, first served
        self.stalled_s = 0.0  # prefill seconds scheduled so far: every stream's tokens move by the growth
        self.decoding = 0  # requests between their first and last token now
        self.chunks_run = 0
        self.steps_stalled = 0

    async def prefill(self, tokens: int) -> None:
        """Prefill ``tokens`` uncached prompt tokens: wait for the lane, then one step per chunk."""
        seconds = self.prefill_token_latency * tokens
        if seconds <= 0:
            return
        if not self.enabled:
            await self._sleep(seconds)
            return
        async with self._lane:
            for size in chunks(tokens, self.chunk_tokens):
                step = self.prefill_token_latency * size
                self.stalled_s += step
                self.chunks_run += 1
                self.steps_stalled += self.decoding
                if self._metrics is not None:
                    self._metrics.chunks.inc()
                    self._metrics.stalled.inc(self.decoding)
                await self._sleep(step)

    @contextlib.contextmanager
    def decode(self) -> Iterator[Stream]:
        """Count a request as decoding while the block runs; its :class:`Stream` gives its delay."""
        self.decoding += 1
        try:
            yield Stream(self) if self.enabled else _STILL
        finally:
            self.decoding -= 1


class _Still:
    """The stream of an engine without the model: never delayed."""

    @staticmethod
    def delay() -> float:
        return 0.0


_STILL = _Still()
