"""The inter-token and total deadlines of a committed stream, without a timer per chunk.

A stream past its commit point can no longer be retried, so a silent
engine must be cut by a deadline; arming a timer per chunk would cost an
allocation per event on the router's hottest loop.  This keeps one lazy
timer per stream instead.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable


class StreamStalled(Exception):
    """The watchdog cut the stream; ``reason``: ``inter_token_timeout`` or ``total_timeout``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _no_poison(exc: BaseException) -> None:
    """A cancelled watchdog's poison: nothing is left to interrupt."""


class Watchdog:
    """Inter-token and total deadlines of a committed stream without a timer per chunk.

    The relay only stores the time of the last chunk; one timer re-arms itself
    lazily and, when a deadline truly passed, poisons the upstream reader so
    the pending read raises.  Time spent writing to a slow client is not the
    engine's silence and is not counted against it.
    """

    __slots__ = ("loop", "idle", "deadline", "poison", "last", "writing", "handle", "fired")

    def __init__(self, loop: asyncio.AbstractEventLoop, idle: float, loop_deadline: float,
                 poison: Callable[[BaseException], None]) -> None:
        self.loop = loop
        self.idle = idle
        self.last = time.perf_counter()  # the relay's clock; set on every chunk
        self.deadline = self.last + (loop_deadline - loop.time())
        self.poison = poison  # makes the relay's pending wait raise
        self.writing = False
        self.fired: str | None = None
        self.handle: asyncio.TimerHandle | None = None

    def arm(self) -> None:
        """Start watching (not needed for a stream that ended before its relay had to wait)."""
        if self.handle is None:
            self.handle = self.loop.call_later(max(0.0, min(self.idle, self.deadline - self.last)), self._check)

    def _check(self) -> None:
        now = time.perf_counter()
        if now >= self.deadline:
            self._fire("total_timeout")
            return
        if self.writing:
            self.last = now
        due = self.last + self.idle
        if now >= due:
            self._fire("inter_token_timeout")
            return
        self.handle = self.loop.call_later(min(due, self.deadline) - now, self._check)

    def _fire(self, reason: str) -> None:
        self.fired = reason
        self.poison(StreamStalled(reason))

    def cancel(self) -> None:
        """Stop watching for good; also drops the references that tie the relay's objects in a cycle.

        ``poison`` is often the splice's bound ``abort`` and the splice holds this watchdog: left
        in place, every stream's splice, watchdog, timer handle, writer and histogram batch
        outlive it as cyclic garbage, and the collector's pauses (milliseconds each, every few
        seconds at a few hundred streams a second) land in the latency of whatever is in flight.
        """
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None
        self.poison = _no_poison

