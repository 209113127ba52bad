"""Reconnect delays: exponential, capped, with full jitter.

When a control plane restarts, every agent in the fleet loses its stream in
the same instant.  Plain exponential backoff would have them all retry at the
same instants too, and the herd knocks the new process over again.  Full
jitter draws each delay uniformly from [0, ceiling], where the ceiling starts
at ``initial`` and doubles per failed attempt up to ``maximum``, which spreads
the fleet over the whole window from the first retry on.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


def ceiling(attempt: int, initial: float, maximum: float) -> float:
    """The largest delay allowed before retry number ``attempt`` (0-based)."""
    if attempt < 0:
        raise ValueError(f"attempt must be >= 0, got {attempt}")
    # Cap the exponent: 2**attempt overflows a float long before a fleet gives up.
    return min(maximum, initial * (2.0 ** min(attempt, 62)))


def full_jitter(attempt: int, initial: float, maximum: float, rng: random.Random | None = None) -> float:
    """A delay drawn uniformly from [0, ceiling(attempt)]."""
    return (rng or random).uniform(0.0, ceiling(attempt, initial, maximum))


@dataclass
class Backoff:
    """Attempt counter for one reconnect loop; ``reset`` after a connection that worked."""

    initial: float
    maximum: float
    rng: random.Random = field(default_factory=random.Random)
    attempt: int = 0

    def next_delay(self) -> float:
        d = full_jitter(self.attempt, self.initial, self.maximum, self.rng)
        self.attempt += 1
        return d

    def reset(self) -> None:
        self.attempt = 0

    def told(self, retry_after: float) -> float:
        """The delay before the next dial when the server said ``Retry-After``: never sooner, jittered over as much again.

        An overloaded control plane sizes ``retry_after`` to spread the agents
        it refused over what it can admit; drawing from [retry_after,
        2 x retry_after] keeps them spread instead of all back at once.
        """
        self.attempt += 1
        return self.rng.uniform(retry_after, 2.0 * retry_after)
