"""The requests standalone routers have in flight to each replica: the autoscaler's signal beside the own router's.

Where clients go through standalone ``llmgw router`` processes (every HA
fleet, and most others), the control plane's in-process router sees none of
their requests: the autoscaler read zero in flight under load and drained a
busy deployment to its ``min``.  So each worker of each router reports its
requests in flight per replica every second (``POST /v1/router/load``, an
empty map too), and the control plane adds the fresh reports to its own
router's count.

A silent router cannot be told from an idle one by what it sends, so it is
told by when: a worker that reported within ``FRESH`` counts; one that
reported within ``REMEMBER`` but not within ``FRESH`` has fallen silent (a
restart, a network partition, a control plane that stalled), and while any
has, the signal is *partial*: the autoscaler takes no new sample, so the last
one holds and nothing scales down on a gap.  A worker silent for longer is
forgotten (a router that was stopped), and the signal is whole again.

Pure: explicit times, no I/O (``routerload_api`` feeds it, ``state`` reads it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

FRESH = 3.0  # seconds: a worker reports every second; three missed reports make it silent
REMEMBER = 60.0  # seconds: a worker silent this long is forgotten (stopped), no longer holding the signal
MAX_WORKERS = 64  # workers kept per router certificate: a router inventing workers replaces its own oldest


@dataclass(frozen=True)
class Report:
    at: float
    outstanding: Mapping[str, int]  # replica id -> requests in flight


class RouterLoad:
    def __init__(self, fresh: float = FRESH, remember: float = REMEMBER) -> None:
        self.fresh, self.remember = fresh, remember
        self._reports: dict[tuple[str, str], Report] = {}  # (router certificate name, worker) -> its last

    def report(self, router: str, instance: str, outstanding: Mapping[str, int], now: float) -> None:
        key = (router, instance)
        if key not in self._reports:
            mine = sorted((r.at, k) for k, r in self._reports.items() if k[0] == router)
            for _, old in mine[:max(0, len(mine) - MAX_WORKERS + 1)]:
                del self._reports[old]  # bounded memory whatever instance names a router sends
        self._reports[key] = Report(now, dict(outstanding))

    def _prune(self, now: float) -> None:
        for key in [k for k, r in self._reports.items() if now - r.at > self.remember]:
            del self._reports[key]

    def totals(self, now: float) -> dict[str, int]:
        """Requests in flight per replica id over every worker that reported within ``fresh``."""
        self._prune(now)
        out: dict[str, int] = {}
        for r in self._reports.values():
            if now - r.at <= self.fresh:
                for rid, n in r.outstanding.items():
                    out[rid] = out.get(rid, 0) + n
        return out

    def silent(self, now: float) -> list[str]:
        """The routers (by certificate name) with a worker that fell silent but is not forgotten yet."""
        self._prune(now)
        return sorted({router for (router, _), r in self._reports.items() if now - r.at > self.fresh})

    def workers(self, now: float) -> int:
        """Workers reporting now."""
        return sum(1 for r in self._reports.values() if now - r.at <= self.fresh)
