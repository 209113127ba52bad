"""What a download tells the people waiting on it, and how often.

A replica pulling forty gigabytes and one whose download is wedged look the
same from the control plane unless bytes are counted where somebody looks,
so progress travels to ``llmgw ctl replicas``.  It is its own message type
(``progress``), never a shard transition: a transition per report would
restart the clock that turns a slow start into a failed one.

Reports are throttled per download (``progress_interval``), not per chunk:
the stream, the control plane and the operator need a few lines a minute,
not one per read.  The rate is measured over the interval between two
reports, smoothed, so a burst or a hiccup does not swing the ETA wildly.
No total is invented when the server sent no length: the field is null and
the listing says "so far".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class RateMeter:
    """Bytes per second, exponentially smoothed across report intervals."""

    smoothing: float = 0.5  # weight of the newest interval
    rate: float | None = None
    _t: float | None = None
    _bytes: int = 0

    def sample(self, now: float, done: int) -> float | None:
        if self._t is None or now <= self._t or done < self._bytes:
            self._t, self._bytes = now, done
            return self.rate
        current = (done - self._bytes) / (now - self._t)
        self.rate = current if self.rate is None else self.smoothing * current + (1 - self.smoothing) * self.rate
        self._t, self._bytes = now, done
        return self.rate

    def restart(self, now: float, done: int) -> None:
        """A new connection: do not count the time spent waiting for it as zero throughput."""
        self._t, self._bytes = now, done


@dataclass(frozen=True)
class Snapshot:
    bytes_done: int
    bytes_total: int | None
    rate_bps: float | None
    note: str | None = None

    def message(self, source: str, file: str, shard_ids: list[str]) -> dict[str, Any]:
        msg: dict[str, Any] = {"type": "progress", "source": source, "file": file,
                               "bytes_done": self.bytes_done, "bytes_total": self.bytes_total,
                               "rate_bps": None if self.rate_bps is None else round(self.rate_bps, 1)}
        if shard_ids:
            msg["shard_ids"] = sorted(shard_ids)
        if self.note:
            msg["note"] = self.note[:512]
        return msg
