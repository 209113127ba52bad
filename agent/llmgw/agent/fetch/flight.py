"""One download per source on a node, however many shards want it.

Eight shards of a tensor-parallel replica start in the same instant and want
the same file; they must produce one GET, and all eight must see its result
or its error.  A *flight* is that one download, keyed by (source, target
path).  Shards join it as *watchers*: each gets the flight's progress (the
latest report at once, then every new one) and awaits the same outcome.

A watcher that leaves (its shard was stopped, or ran out of start time)
leaves only itself: the others keep waiting on the same download.  When the
last one leaves, the download is cancelled, and its partial file stays for
the next attempt to resume.

Flights live in the agent's event loop (one per process, one agent per
node).  Across processes there is no shared registry; the on-disk protocol
(per-owner partial names, atomic rename) keeps them correct regardless.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from llmgw.agent.fetch.progress import Snapshot

log = logging.getLogger(__name__)

Emit = Callable[[dict[str, Any]], None]
Key = tuple[str, str]  # (source URL, final path)


class FlightConflict(RuntimeError):
    """Two declarations of one source disagree on its digest while it is being fetched."""


@dataclass(eq=False)
class Flight:
    key: Key
    file: str
    sha256: str | None
    watchers: dict[str, Emit] = field(default_factory=dict)
    last: Snapshot | None = None
    task: asyncio.Task[str] | None = None
    reports: int = 0  # progress messages sent, all watchers together
    stopping: bool = False  # cancelled when its last watcher left; still cleaning up (a fetch process to reap)

    @property
    def source(self) -> str:
        return self.key[0]

    def publish(self, snap: Snapshot) -> None:
        """Send ``snap`` to every watcher: one message per stream, naming its shards."""
        self.last = snap
        groups: list[tuple[Emit, list[str]]] = []  # by equality: two bound methods of one stream are equal, not identical
        for shard_id, emit in self.watchers.items():
            for e, ids in groups:
                if e == emit:
                    ids.append(shard_id)
                    break
            else:
                groups.append((emit, [shard_id]))
        for emit, shard_ids in groups:
            try:
                emit(snap.message(self.source, self.file, shard_ids))
                self.reports += 1
            except Exception:  # a broken watcher must not break the download the others wait on
                log.exception("progress watcher for %s failed", self.source)


Runner = Callable[[Flight], Awaitable[str]]


class Flights:
    """The registry of downloads in progress in one event loop."""

    def __init__(self) -> None:
        self.active: dict[Key, Flight] = {}
        self.started = 0  # downloads begun (tests, logs)

    async def join(self, key: Key, file: str, sha256: str | None, shard_id: str, emit: Emit,
                   run: Runner) -> str:
        """Wait on the download for ``key`` (starting it with ``run`` if none is in flight).

        A download being stopped is not joined: its end is a cancellation,
        which would reach this caller as if it had been cancelled itself.
        The caller waits for it to finish cleaning up and starts its own.
        """
        flight = self.active.get(key)
        while flight is not None and flight.stopping and flight.task is not None:
            await asyncio.wait([flight.task])
            flight = self.active.get(key)
        if flight is not None and flight.sha256 != sha256:
            raise FlightConflict(f"{key[0]} is already being fetched for a declaration with sha256 "
                                 f"{flight.sha256 or '(none)'}; this one declares {sha256 or '(none)'}")
        if flight is None:
            flight = Flight(key=key, file=file, sha256=sha256)
            self.active[key] = flight
            self.started += 1
            flight.task = asyncio.get_running_loop().create_task(self._run(flight, run), name=f"fetch {key[0]}")
        flight.watchers[shard_id] = emit
        if flight.last is not None:
            try:
                emit(flight.last.message(flight.source, flight.file, [shard_id]))
            except Exception:
                log.exception("progress watcher for %s failed", flight.source)
        assert flight.task is not None
        try:
            return await asyncio.shield(flight.task)
        except asyncio.CancelledError:
            flight.watchers.pop(shard_id, None)
            if not flight.watchers and not flight.task.done():
                log.info("fetch of %s: nobody waits for it any more; stopping (the partial file stays "
                         "for a later resume)", key[0])
                flight.stopping = True
                flight.task.cancel()
            raise
        finally:
            flight.watchers.pop(shard_id, None)

    async def _run(self, flight: Flight, run: Runner) -> str:
        try:
            return await run(flight)
        finally:
            if self.active.get(flight.key) is flight:
                del self.active[flight.key]
            log.debug("fetch of %s ended after %d progress message(s)", flight.source, flight.reports)


_registries: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Flights]" = weakref.WeakKeyDictionary()


def flights() -> Flights:
    """The registry of the running loop (futures cannot cross loops, so one each)."""
    loop = asyncio.get_running_loop()
    reg = _registries.get(loop)
    if reg is None:
        reg = _registries[loop] = Flights()
    return reg
