"""How long a new replica of each deployment takes to serve: the autoscaler's lead time, measured.

A scale-up is worth something only once the new replica serves, minutes
after it is placed (weights fetched or read, the engine loaded, its first
completion answered).  The control plane sees every replica it places go
from placement (``created_at``) to Ready (``ready_since``), so it knows that
time per deployment, on the nodes and caches it actually has, instead of a
number the operator guesses.  The lead time is the median of the last
``KEEP`` replicas it placed that became Ready: one slow fetch does not move
it, a model whose weights are now cached everywhere shortens it within a few
starts.  Adopted replicas (started by an earlier control plane) say nothing
of it; until one is measured the lead is unknown and nothing is anticipated.

Pure: fed the replica book each pass (``controlplane/autoscaler.py``).
"""

from __future__ import annotations

import statistics
from collections import deque

from llmgw.controlplane.replicas import ReplicaBook

KEEP = 8  # the starts the median is taken over


class LeadTimes:
    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        self._starts: dict[str, deque[float]] = {}  # deployment key -> the last starts, seconds
        self._seen: set[str] = set()  # replica ids already measured (pruned to the book's)

    def note(self, book: ReplicaBook, keys: set[str] | None = None) -> None:
        """Measure every replica (of ``keys``' deployments, None: all) that became Ready since the last pass."""
        live = set(book.replicas)
        self._seen &= live
        for rid, r in book.replicas.items():
            if rid in self._seen or r.ready_since is None or r.adopted or (keys is not None and r.key not in keys):
                continue
            self._seen.add(rid)
            took = r.ready_since - r.created_at
            if took >= 0:
                self._starts.setdefault(r.key, deque(maxlen=self.keep)).append(took)

    def lead(self, key: str) -> float | None:
        """The deployment's measured start time in seconds; None before its first measured start."""
        starts = self._starts.get(key)
        return statistics.median(starts) if starts else None

    def forget(self, keys: set[str]) -> None:
        """Deployments gone from the catalog."""
        for key in set(self._starts) - keys:
            del self._starts[key]
