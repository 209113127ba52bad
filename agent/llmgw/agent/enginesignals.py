"""The agent reads its engines' own autoscaling signals and sends the control plane what moved.

Only on request: a control plane that autoscales a deployment on an engine
signal (``queue_depth``, ``kv_cache_use``) sends ``engine_signals_wanted``
naming the rank-0 shards on this node to read, the signal of each, its dead
band, the period and the refresh.  Until then, and on every new stream until its
control plane says, nothing is read and nothing sent (an older control plane
never asks, and an unknown message type would close its stream).

The agent reads, not the routers or the control plane: it is beside the engines,
on loopback with the engine key (``driver.engine_request``, as the probes and the
sleep calls), and one read per engine per period is all it costs; a router sees
only its share of the traffic, and a control plane scraping every engine is the
pull model the stream avoids.  Each read is bounded in time (half the period, at
most ``READ_TIMEOUT``) and size (``MAX_PAGE``: a longer page counts as unreadable),
reads run concurrently, and the loop only awaits, so a slow engine delays nothing
else the agent does.  What goes up is decided by ``signalband.Deadband``: one
``engine_signals`` message per node and period at most, only with the values that
moved beyond their dead band, everything once a refresh.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from llmgw.agent.shardstate import ShardState
from llmgw.agent.signalband import Deadband, Reading
from llmgw.enginesignals import read_signal

log = logging.getLogger(__name__)

READ_TIMEOUT = 2.0  # seconds a read of /metrics may take, at most (and at most half the period)
MAX_PAGE = 2 * 1024 * 1024  # bytes of /metrics read at most (vLLM's page: tens of kB; with 8 DP engines a few hundred)
CHUNK = 64 * 1024


async def read_page(session: aiohttp.ClientSession, url: str, kwargs: dict[str, Any], timeout: float,
                    limit: int = MAX_PAGE) -> str | None:
    """The engine's ``/metrics`` text, or None: no 200 within ``timeout``, or longer than ``limit`` bytes."""
    try:
        async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=timeout), **kwargs) as resp:
            if resp.status != 200 or (resp.content_length or 0) > limit:
                return None
            body = bytearray()
            while chunk := await resp.content.read(CHUNK):
                body += chunk
                if len(body) > limit:
                    return None
            return body.decode("utf-8", "replace")
    except (asyncio.TimeoutError, aiohttp.ClientError, ValueError):
        return None


class EngineSignals:
    """This node's reads for the control plane on the current stream; ``send`` queues a message on it."""

    def __init__(self, supervisor: Any, send: Callable[[dict[str, Any]], None]) -> None:
        self.supervisor = supervisor  # ``Supervisor``: its shards, its driver's engine endpoint
        self.send = send
        self.period = 5.0
        self.refresh = 30.0
        self.wanted: dict[str, tuple[str, float]] = {}  # shard id -> (signal, dead band)
        self.band = Deadband()
        self.reads = 0  # pages read, for tests and the benchmark
        self.sent = 0  # messages sent
        self._task: asyncio.Task[None] | None = None

    def want(self, msg: dict[str, Any]) -> None:
        """The control plane's ``engine_signals_wanted``: what to read from now on (nothing: stop)."""
        self.period, self.refresh = float(msg["period"]), float(msg["refresh"])
        self.wanted = {s["shard_id"]: (s["signal"], float(s["deadband"])) for s in msg["shards"]}
        if not self.wanted:
            self.stop()
        elif self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="engine signals")
        log.debug("engine signals: reading %d engine(s) every %gs", len(self.wanted), self.period)

    def stop(self) -> None:
        """Read nothing more (the stream ended, or nothing is wanted); the next control plane starts afresh."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self.wanted, self.band = {}, Deadband()

    async def _run(self) -> None:
        while self.wanted:
            began = time.monotonic()
            try:
                await self.once()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not end the reads for good
                log.exception("engine signals: a round of reads failed")
            await asyncio.sleep(max(0.0, self.period - (time.monotonic() - began)))

    async def once(self) -> dict[str, Any] | None:
        """Read every wanted engine once; send (and return) the message the dead band lets through."""
        wanted = dict(self.wanted)
        values = await asyncio.gather(*(self._read(sid, signal) for sid, (signal, _) in wanted.items()))
        read = {sid: Reading(v, band) for (sid, (_, band)), v in zip(wanted.items(), values)}
        due = self.band.due(time.monotonic(), read, self.refresh)
        if not due:
            return None
        msg = {"type": "engine_signals",
               "shards": [{"shard_id": sid, "signal": wanted[sid][0], "value": v} for sid, v in due.items()]}
        self.send(msg)
        self.sent += 1
        return msg

    async def _read(self, shard_id: str, signal: str) -> float | None:
        shard = self.supervisor.shards.get(shard_id)
        if shard is None or shard.state is not ShardState.READY or not shard.port:
            return None
        session, url, kwargs = self.supervisor.driver.engine_request(shard)
        page = await read_page(session, url, kwargs, min(READ_TIMEOUT, self.period / 2))
        self.reads += 1
        return None if page is None else read_signal(page, str(shard.spec["profile"]["engine"]), signal)
