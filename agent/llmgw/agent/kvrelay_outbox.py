"""Route-key changes waiting to go upstream, per replica, coalesced and bounded.

A busy replica stores and evicts blocks many times a second; most of a key's life can fall
between two messages. So changes are kept as net effects against what the control plane was
last told: a key added and removed again before it was sent is sent neither way (and the
reverse), and a reset drops everything pending before it. What is pending is bounded per
replica (``max_pending``): past it the replica's pending changes become one resend of its
whole current set (a reset and every key the relay holds), whose size the route map bounds.

``take`` builds one ``kv_routes`` message of at most ``max_keys`` keys, replicas in turn,
resets first; the rest waits for the next message (the relay paces them).

Pure logic: no sockets, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from llmgw.kvroutekeys import to_hex

DEFAULT_MAX_PENDING = 1 << 16
MAX_REPLICAS_PER_MESSAGE = 64  # the stream schema's bound


@dataclass
class Pending:
    replica_id: str
    shard_id: str
    current: Callable[[], list[int]]  # every key held now, for a resend
    max_pending: int = DEFAULT_MAX_PENDING
    reset_due: bool = False
    added: dict[int, None] = field(default_factory=dict)
    removed: dict[int, None] = field(default_factory=dict)
    resends: int = 0  # times the pending changes overflowed into a full resend

    def __len__(self) -> int:
        return len(self.added) + len(self.removed)

    # the route map's sink
    def add(self, key: int) -> None:
        if key in self.removed:
            del self.removed[key]
        else:
            self.added[key] = None
            self._bound()

    def remove(self, key: int) -> None:
        if key in self.added:
            del self.added[key]
        else:
            self.removed[key] = None
            self._bound()

    def reset(self) -> None:
        self.reset_due = True
        self.added.clear()
        self.removed.clear()

    def resend(self) -> None:
        """Tell the control plane everything afresh: a reset and every key held now."""
        self.reset()
        self.added = dict.fromkeys(self.current())

    def _bound(self) -> None:
        if len(self) > self.max_pending:
            self.resends += 1
            self.resend()

    @property
    def due(self) -> bool:
        return self.reset_due or bool(self.added) or bool(self.removed)


class Outbox:
    def __init__(self) -> None:
        self.replicas: dict[str, Pending] = {}  # by shard id
        self._turn = 0

    def due(self) -> bool:
        return any(p.due for p in self.replicas.values())

    def take(self, max_keys: int) -> dict[str, Any] | None:
        """One ``kv_routes`` message of at most ``max_keys`` keys, or None when nothing is pending."""
        order = list(self.replicas.values())
        if not order:
            return None
        start = self._turn % len(order)
        order = order[start:] + order[:start]
        self._turn += 1
        entries: list[dict[str, Any]] = []
        room = max_keys
        for p in sorted(order, key=lambda p: not p.reset_due):  # resets first: a stale set misroutes
            if not p.due or len(entries) >= MAX_REPLICAS_PER_MESSAGE:
                continue
            if room <= 0 and not p.reset_due:
                continue
            entry: dict[str, Any] = {"replica_id": p.replica_id, "shard_id": p.shard_id}
            if p.reset_due:
                entry["reset"] = True
                p.reset_due = False
            removed = _pop(p.removed, room)
            room -= len(removed)
            added = _pop(p.added, room)
            room -= len(added)
            if removed:
                entry["removed"] = [to_hex(k) for k in removed]
            if added:
                entry["added"] = [to_hex(k) for k in added]
            entries.append(entry)
        return {"type": "kv_routes", "replicas": entries} if entries else None


def _pop(d: dict[int, None], n: int) -> list[int]:
    """Up to ``n`` keys off the front of ``d`` (oldest first)."""
    if n <= 0 or not d:
        return []
    if n >= len(d):
        out = list(d)
        d.clear()
        return out
    out = []
    for k in d:
        out.append(k)
        if len(out) == n:
            break
    for k in out:
        del d[k]
    return out
