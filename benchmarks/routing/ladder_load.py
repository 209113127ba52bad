"""Open-loop Poisson load through a router with the official ``openai`` client: what a client sees.

Open loop, as llm-d's ladder sends it: arrivals follow the schedule whatever the answers do, so
a saturated fleet builds a queue instead of slowing its own load, and every scorer is fed the
same requests at the same times. Each request is a streamed ``/v1/completions`` of exactly
``max_tokens`` tokens (``min_tokens`` too, as vLLM takes it); its record holds the time to the
first token, the tokens received and any error.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx
import openai


@dataclass
class Record:
    sent: float  # seconds after the run began
    group: int
    turn: int
    ttft: float | None = None
    tokens: int = 0
    error: str | None = None


async def _one(client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int, rec: Record,
               t0: float) -> None:
    start = t0 + rec.sent
    try:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
                                                 extra_body={"min_tokens": max_tokens})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                if rec.ttft is None:
                    rec.ttft = time.monotonic() - start
                rec.tokens += 1
    except (openai.OpenAIError, httpx.HTTPError) as e:
        rec.error = f"{type(e).__name__}: {str(e)[:200]}"


async def run_load(base_url: str, model: str, times: list[float], requests: list[tuple[int, int, str]],
                   max_tokens: int, timeout: float = 600) -> tuple[list[Record], float]:
    """Send ``requests`` (group, turn, prompt) at ``times`` (seconds from the start); every
    request's record and the run's wall time (first send to last answer)."""
    records = [Record(sent=t, group=g, turn=k) for t, (g, k, _) in zip(times, requests)]
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=1024)
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=timeout,
                                  http_client=openai.DefaultAsyncHttpxClient(limits=limits, timeout=timeout)) as client:
        t0 = time.monotonic()
        tasks = []
        for rec, (_, _, prompt) in zip(records, requests):
            delay = t0 + rec.sent - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(client, model, prompt, max_tokens, rec, t0)))
        await asyncio.gather(*tasks)
        wall = time.monotonic() - t0
    return records, wall
