"""A token bucket: ``capacity`` tokens at most, refilled at ``rate`` a second, one taken per event.

Pure: ``take`` is told the time.  Shared by the routers' post budgets
(``routerposts``) and admission control (its registration rate and its
handshake trickle).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenBucket:
    capacity: float
    rate: float
    tokens: float
    at: float

    def take(self, now: float) -> bool:
        self.tokens = min(self.capacity, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True
