"""When the whole-fleet reconcile runs: on news, while work is pending, and every ``FULL_PASS_EVERY`` seconds.

A settled fleet of thousands of nodes then costs a lifecycle pass per
tick, not a reconcile of every replica.  ``kick`` (an observation) also
wakes the loop; ``mark`` (something found during a tick) only makes the
next pass due.
"""

from __future__ import annotations

import asyncio

FULL_PASS_EVERY = 30.0  # seconds: a settled fleet is still reconciled whole this often


class PassGate:
    def __init__(self) -> None:
        self.woken = asyncio.Event()
        self.dirty = True  # something may have changed since the last whole-fleet pass
        self.settled = False  # the last pass left nothing to do
        self._last_full = float("-inf")

    def kick(self) -> None:
        """Something was observed: the next tick reconciles the whole fleet."""
        self.dirty = True
        self.woken.set()

    def mark(self) -> None:
        """Something changed during a tick: this tick's pass (or the next) is due, without waking the loop."""
        self.dirty = True

    def open(self, now: float) -> bool:
        """Whether a whole pass runs now; if so it is counted as run."""
        if not (self.dirty or not self.settled or now - self._last_full >= FULL_PASS_EVERY):
            return False
        self.dirty, self._last_full = False, now
        return True
