"""How late the control plane's event loop runs: its own stalls, measured.

A control plane that is paused (a long GC pass, VM steal, SIGSTOP, a pass
that held the loop) reads no heartbeat while it is away, and then finds every
node silent for as long as it was.  That silence is the control plane's, not
the agents': ``take`` hands the stall time out once, so the lifecycle can
push every node's silence deadline back by it (as Nomad extends heartbeat
TTLs after a leader failover), and ``lag`` tells admission control that the
loop is behind.

A sampler task sleeps ``period`` and records how late it woke.  ``take``
also counts a sleep that is overdue right now, so a caller that runs first
after a pause (before the sampler) is not told "no stall".

``behind`` (what admission control reads) leaves out the time the loop was
``held`` on purpose by a reconcile pass: a pass over 10,000 nodes on half a
core holds the loop for seconds, paced to at most half of it, and read as
overload it made admission drop or refuse the very agents the pass was
placing replicas for.  ``take`` (what the heartbeat deadlines are moved by)
keeps it: no heartbeat was read while the pass ran.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class LoopLag:
    def __init__(self, period: float = 0.25, clock: Callable[[], float] = time.monotonic):
        self.period = period
        self.clock = clock
        self.lag = 0.0  # how late the last completed sample woke (seconds)
        self.total = 0.0  # every stall seen, for metrics and logs
        self._due: float | None = None  # when the sleeping sample should wake
        self._owed = 0.0  # lateness of completed samples not yet taken
        self._given = 0.0  # lateness of the current sample already taken
        self._held = 0.0  # seconds the current sample's wait was held by reconcile passes (``held``)

    def take(self) -> float:
        """Seconds the loop ran late since the last call (including a wake-up overdue now)."""
        now = self.clock()
        current = 0.0 if self._due is None else max(0.0, now - self._due)
        extra, self._given = max(0.0, current - self._given), max(current, self._given)
        out, self._owed = self._owed + extra, 0.0
        return out

    def held(self, seconds: float) -> None:
        """The caller held the loop ``seconds`` on purpose (a paced reconcile pass): not overload."""
        if self._due is not None:
            self._held += seconds

    def behind(self) -> float:
        """How far behind the loop is now, its deliberate holds left out: the last sample's
        lateness, or the overdue one's."""
        if self._due is None:
            return self.lag
        return max(self.lag, self.clock() - self._due - self._held)

    def _woke(self, due: float) -> None:
        late = max(0.0, self.clock() - due)
        self.lag = max(0.0, late - self._held)
        self.total += late
        self._owed += max(0.0, late - self._given)
        self._given = self._held = 0.0
        self._due = None

    async def run(self) -> None:
        while True:
            due = self.clock() + self.period
            self._due = due
            await asyncio.sleep(self.period)
            self._woke(due)
