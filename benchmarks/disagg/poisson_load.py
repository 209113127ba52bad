"""Open-loop load for the disaggregation benchmark: Poisson arrivals of long-prompt streamed completions.

Open loop, because that is how prefill interference shows: a closed loop waits for answers
before it sends more, so a stalled engine slows the arrivals that stall it, and the two
layouts would not be fed the same load. Arrival times come from a seeded generator, so both
layouts get the same schedule. Every prompt is distinct from its first word (no prefix-cache
hit anywhere), as independent long conversations are.

Per request it records what a client sees: time to the first content chunk, the gap between
each content chunk and the next (one chunk per token from the simulator: the inter-token
latency), and the tokens received.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class Record:
    sent: float  # seconds after the run began
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    done: float | None = None  # seconds after the run began
    error: str | None = None


def arrivals(rate: float, duration: float, seed: int) -> list[float]:
    """Poisson arrival times (seconds from the start) at ``rate`` per second within ``duration``."""
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        out.append(t)


def body(model: str, n: int, tag: str, input_tokens: int, output_tokens: int) -> bytes:
    """A completion of ``input_tokens`` distinct words (one simulator token each), streaming
    exactly ``output_tokens`` tokens."""
    prompt = " ".join(f"{tag}r{n}w{k}" for k in range(input_tokens))
    return json.dumps({"model": model, "prompt": prompt, "max_tokens": output_tokens, "min_tokens": output_tokens,
                       "stream": True}).encode()


async def _one(session: aiohttp.ClientSession, url: str, data: bytes, rec: Record, t0: float) -> None:
    clock = time.monotonic
    start = t0 + rec.sent
    last = None
    try:
        async with session.post(f"{url}/v1/completions", data=data,
                                headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                if b'"error"' in line[:20]:
                    rec.error = line.decode(errors="replace")[:200]
                    return
                now = clock()
                if last is None:
                    rec.ttft = now - start
                else:
                    rec.gaps.append(now - last)
                last = now
                rec.tokens += 1
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        rec.error = repr(e)
    finally:
        rec.done = clock() - t0


async def run_load(url: str, model: str, rate: float, duration: float, seed: int, input_tokens: int,
                   output_tokens: int, tag: str, timeout: float = 600) -> tuple[list[Record], float]:
    """Send the schedule to ``url``; every request's record and the run's wall time (first send
    to last answer)."""
    times = arrivals(rate, duration, seed)
    datas = [body(model, n, tag, input_tokens, output_tokens) for n in range(len(times))]
    records = [Record(sent=t) for t in times]
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        t0 = time.monotonic()
        tasks = []
        for rec, data in zip(records, datas):
            delay = t0 + rec.sent - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(session, url, data, rec, t0)))
        await asyncio.gather(*tasks)
        wall = time.monotonic() - t0
    return records, wall
