"""Retry budget: retries may add at most a fixed share to the load.

Counting over a sliding window of recent requests (rather than only those in
flight) is what bounds amplification when an outage turns every request into
a fast failure: those requests are never in flight long enough to show up in
a concurrency count, yet each would be retried.  Within any window, retries
stay at or below ``max(minimum, ratio * requests)``.
"""

from __future__ import annotations

import time
from typing import Callable


class RetryBudget:
    def __init__(
        self,
        ratio: float,
        minimum: int,
        window_s: float,
        clock: Callable[[], float] = time.monotonic,
        buckets: int = 10,
    ) -> None:
        self.ratio = ratio
        self.minimum = minimum
        self._clock = clock
        self._width = window_s / buckets
        self._n = buckets
        self._requests = [0] * buckets
        self._retries = [0] * buckets
        self._slot = int(clock() / self._width)
        self._total_requests = 0
        self._total_retries = 0

    def _advance(self) -> int:
        slot = int(self._clock() / self._width)
        if slot != self._slot:
            steps = min(slot - self._slot, self._n)
            for s in range(self._slot + 1, self._slot + 1 + steps):
                i = s % self._n
                self._total_requests -= self._requests[i]
                self._total_retries -= self._retries[i]
                self._requests[i] = 0
                self._retries[i] = 0
            self._slot = slot
        return slot % self._n

    @property
    def total_requests(self) -> int:
        """Requests started within the window."""
        self._advance()
        return self._total_requests

    @property
    def total_retries(self) -> int:
        """Retries spent within the window."""
        self._advance()
        return self._total_retries

    def note_request(self) -> None:
        i = self._advance()
        self._requests[i] += 1
        self._total_requests += 1

    def allowed(self) -> int:
        self._advance()
        return max(self.minimum, int(self.ratio * self._total_requests))

    def try_acquire(self) -> bool:
        """Spend one retry if the window has room; False means do not retry."""
        i = self._advance()
        if self._total_retries + 1 > max(self.minimum, int(self.ratio * self._total_requests + 1e-9)):
            return False
        self._retries[i] += 1
        self._total_retries += 1
        return True
