"""Passive outlier ejection: take an endpoint out after failures in a row.

Pure logic over a small per-endpoint record and a clock value passed in,
so the rules are testable without sockets or sleeps.

Rules:
- ``consecutive_errors`` failures in a row eject the endpoint for
  ``base_ejection * n`` (capped at ``max_ejection``), n being how many times
  in a row it has been ejected.
- After an ejection it is back on probation: a single failure ejects it
  again (for longer); a success clears probation.  The multiplier resets
  once it has served successfully for as long as its last ejection lasted.
- No more than ``max_ejection_share`` of a model's endpoints (at least one)
  are out at once: when a whole model is failing, evicting everything but
  one endpoint would pile the traffic onto it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .settings import Outlier


@dataclass
class Health:
    consecutive_failures: int = 0
    ejected_until: float = 0.0
    ejections: int = 0  # consecutive ejections (the backoff multiplier)
    probation: bool = False
    last_ejection_len: float = 0.0
    # The current episode: from the first ejection until a success clears it.  An endpoint
    # between two ejections (on probation, not yet proven healthy) is still in it; this is
    # what the router reports to the control plane.
    episode_since: float | None = None
    episode_failures: int = 0
    last_failure: str = ""  # the outcome of the last failed attempt ("upstream_5xx", "timeout", ...)

    def is_ejected(self, now: float) -> bool:
        return now < self.ejected_until


class OutlierPolicy:
    def __init__(self, cfg: Outlier) -> None:
        self.cfg = cfg

    def ejection_cap(self, group_size: int) -> int:
        """How many of ``group_size`` endpoints may be ejected at once."""
        return max(1, math.floor(self.cfg.max_ejection_share * group_size + 1e-9))

    def on_success(self, h: Health, now: float) -> None:
        h.consecutive_failures = 0
        if h.probation:
            h.probation = False
        h.episode_since, h.episode_failures = None, 0
        if h.ejections and now - h.ejected_until >= h.last_ejection_len:
            h.ejections = 0

    def on_failure(self, h: Health, now: float, ejected_in_group: int, group_size: int) -> bool:
        """Record a failure; True when this failure ejected the endpoint."""
        if h.is_ejected(now):
            return False  # a late result from before the ejection
        h.consecutive_failures += 1
        h.episode_failures += 1
        threshold = 1 if h.probation else self.cfg.consecutive_errors
        if h.consecutive_failures < threshold:
            return False
        if ejected_in_group >= self.ejection_cap(group_size):
            return False
        h.ejections += 1
        length = min(self.cfg.base_ejection * h.ejections, self.cfg.max_ejection)
        h.last_ejection_len = length
        h.ejected_until = now + length
        h.consecutive_failures = 0
        h.probation = True
        if h.episode_since is None:
            h.episode_since = now
        return True
