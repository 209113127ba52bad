"""The agent's calls to an engine's sleep mode: ``POST /sleep?level=N`` and ``POST /wake_up``.

Scale to sleep (docs/autoscaling.md) is decided by the control plane, which
sends ``sleep`` and ``wake`` down the agent stream; the agent is the only one
that calls the engine's dev-mode routes, over the address its own probes use
(loopback where the engine binds every interface), with the engine key and
the engine's TLS as for every probe.  After the engine answered, the agent
reports the shard's ``sleeping`` in a ``shard_status``; the control plane
repeats a request that brought no report, so a call that failed is only
logged here.

Calls on one shard run one at a time: a wake that overtook the sleep it
follows would leave the engine asleep while the control plane is told it is
awake.  Only a Ready rank 0 launched in sleep mode is put to sleep.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp

from llmgw.agent.shard import Shard
from llmgw.agent.shardstate import ShardState

log = logging.getLogger(__name__)

# Seconds a call may take: a level-2 wake reads the weights again (tens of seconds for a large model).
CALL_TIMEOUT = 300.0


class EngineSleep:
    """Sleep and wake one node's engines on the control plane's word."""

    def __init__(self, supervisor: Any, timeout: float = CALL_TIMEOUT) -> None:
        self.supervisor = supervisor  # ``Supervisor``: its shards, its driver's engine endpoint, its emit
        self.timeout = timeout
        self._locks: dict[str, asyncio.Lock] = {}

    def _lock(self, shard_id: str) -> asyncio.Lock:
        """The shard's lock; those of shards the supervisor no longer has are dropped (none is held)."""
        for sid in [sid for sid, lock in self._locks.items()
                    if sid not in self.supervisor.shards and not lock.locked()]:
            del self._locks[sid]
        return self._locks.setdefault(shard_id, asyncio.Lock())

    def _shard(self, shard_id: str, what: str) -> Shard | None:
        shard = self.supervisor.shards.get(shard_id)
        if shard is None or shard.state is not ShardState.READY or not shard.port:
            log.warning("%s of %s refused: not a Ready rank 0 here", what, shard_id)
            return None
        if not shard.spec.get("sleep_mode"):
            log.warning("%s of %s refused: it was not launched in sleep mode", what, shard_id)
            return None
        return shard

    async def recheck(self) -> None:
        """Ask every Ready sleep-mode engine whether it sleeps (``GET /is_sleeping``) and report it.

        Run on each new stream: an agent that restarted adopted its engines
        without knowing which ones sleep, and a control plane that restarted
        knows nothing; the engine is the only one that knows for sure.
        """
        for shard in list(self.supervisor.shards.values()):
            if shard.state is not ShardState.READY or not shard.port or not shard.spec.get("sleep_mode"):
                continue
            async with self._lock(shard.shard_id):
                session, url, kwargs = self.supervisor.driver.engine_request(shard)
                try:
                    async with session.get(f"{url}/is_sleeping", timeout=aiohttp.ClientTimeout(total=10),
                                           **kwargs) as resp:
                        doc = await resp.json(content_type=None) if resp.status == 200 else None
                except (asyncio.TimeoutError, aiohttp.ClientError, ValueError) as e:
                    log.warning("cannot ask %s whether it sleeps: %s: %s", shard.shard_id, type(e).__name__, e)
                    continue
                asleep = doc.get("is_sleeping") if isinstance(doc, dict) else None
                if not isinstance(asleep, bool) or shard.state is not ShardState.READY:
                    continue
                if asleep != shard.sleeping:
                    log.info("%s: engine %s (asked after connecting)", shard.shard_id, "asleep" if asleep else "awake")
                shard.sleeping = asleep
                self.supervisor.emit(self.supervisor.status_message(shard))

    async def sleep(self, shard_id: str, level: int) -> bool:
        return await self._call(shard_id, f"/sleep?level={int(level)}", True)

    async def wake(self, shard_id: str) -> bool:
        return await self._call(shard_id, "/wake_up", False)

    async def _call(self, shard_id: str, path: str, sleeping: bool) -> bool:
        what = "sleep" if sleeping else "wake"
        async with self._lock(shard_id):
            shard = self._shard(shard_id, what)
            if shard is None:
                return False
            session, url, kwargs = self.supervisor.driver.engine_request(shard)
            try:
                async with session.post(f"{url}{path}", timeout=aiohttp.ClientTimeout(total=self.timeout),
                                        **kwargs) as resp:
                    body = await resp.text(errors="replace")
                    status = resp.status
            except (asyncio.TimeoutError, aiohttp.ClientError) as e:
                log.warning("%s of %s: %s: %s", what, shard_id, type(e).__name__, e)
                return False
            if status != 200:
                log.warning("%s of %s: the engine answered HTTP %d: %.300s", what, shard_id, status, body)
                return False
            if shard.state is not ShardState.READY:  # stopped while the engine was answering
                return False
            shard.sleeping = sleeping
            log.info("%s: engine %s", shard_id, "asleep" if sleeping else "awake")
            self.supervisor.emit(self.supervisor.status_message(shard))
            return True
