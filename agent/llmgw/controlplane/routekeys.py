"""Route keys per replica, as agents report them (``kv_routes``), bounded.

Each agent relays what its engines hold in their prefix caches as opaque route keys
(``llmgw.agent.kvrelay``); this book keeps, per replica, the keys last reported, at most
``max_keys`` of them (the oldest dropped past that: an old key is the likeliest to have been
evicted, and a missing key costs a cache hit, never a wrong answer).

A report is believed only for a replica whose rank 0 this control plane books on the node
whose stream carried it: a node cannot claim keys for another node's replica, nor for a
shard the control plane refused (a stray). Entries that fail that are counted and logged,
and the rest of the message still counts.

Every accepted change is also appended to a bounded change log with a revision, the form a
router watch reads deltas in; a replica that leaves the book is dropped with a reset.

Pure logic: no sockets, no clock.
"""

from __future__ import annotations

import logging
import secrets
from itertools import islice
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable

from llmgw.kvroutekeys import from_hex, to_hex

log = logging.getLogger("llmgw.controlplane.routekeys")

MAX_KEYS_PER_REPLICA = 1 << 17  # 131,072 blocks: 2 M tokens at 16 tokens per block
MAX_KEYS_PER_MESSAGE = 1024  # what agents are told (the stream schema's bound per array)
MAX_MESSAGES_PER_SECOND = 10.0  # per stream
CHANGE_LOG = 1 << 16  # changes kept for readers of deltas
MAX_KEYS_PER_ANSWER = 1 << 16  # keys in one answer to a reader; the rest in its next


@dataclass
class ReplicaKeys:
    node_id: str
    shard_id: str
    keys: OrderedDict[int, None] = field(default_factory=OrderedDict)
    resets: int = 0
    dropped: int = 0  # keys dropped past the cap
    updated_at: float | None = None  # the control plane's clock at the last report


@dataclass(frozen=True)
class Change:
    """One replica's change at ``revision``: a reset (forget its keys first), then keys removed and added."""

    revision: int
    replica_id: str
    reset: bool
    added: tuple[int, ...]
    removed: tuple[int, ...]


class RouteKeyBook:
    def __init__(self, owner: Callable[[str, str], str | None], max_keys: int = MAX_KEYS_PER_REPLICA,
                 change_log: int = CHANGE_LOG) -> None:
        """``owner(node_id, shard_id)``: the replica id of that rank-0 shard as booked on that node, else None."""
        self.owner = owner
        self.max_keys = max_keys
        self.replicas: dict[str, ReplicaKeys] = {}
        self.changes: deque[Change] = deque(maxlen=change_log)
        self.revision = 0
        self.refused = 0  # entries for a replica the node does not run
        self.applied = 0  # entries applied
        # Identifies this book for its lifetime: after a restart revisions start over, and a
        # reader must not take an old number for one of this book's.
        self.epoch = secrets.token_hex(8)
        self.listeners: list[Callable[[], None]] = []  # told after every change (long polls wake)
        self._warned: set[tuple[str, str]] = set()

    def accepted_message(self) -> dict[str, Any]:
        return {"type": "kv_routes_accepted", "max_keys_per_message": MAX_KEYS_PER_MESSAGE,
                "max_messages_per_second": MAX_MESSAGES_PER_SECOND}

    def apply(self, node_id: str, msg: dict[str, Any], now: float | None = None) -> None:
        """A validated ``kv_routes`` from ``node_id``'s current stream, received at ``now``."""
        for entry in msg["replicas"]:
            rid, sid = entry["replica_id"], entry["shard_id"]
            if self.owner(node_id, sid) != rid:
                self.refused += 1
                if (node_id, rid) not in self._warned:  # once per node and replica: a loop must not flood the log
                    if len(self._warned) > 4096:
                        self._warned.clear()
                    self._warned.add((node_id, rid))
                    log.warning("node %s: route keys for %s (shard %s), which this node does not run as rank 0; "
                                "ignored", node_id, rid, sid)
                continue
            book = self.replicas.get(rid)
            if book is None or book.node_id != node_id or book.shard_id != sid:
                book = self.replicas[rid] = ReplicaKeys(node_id, sid)
            book.updated_at = now
            reset = bool(entry.get("reset"))
            if reset:
                book.keys.clear()
                book.resets += 1
            removed = tuple(from_hex(k) for k in entry.get("removed", ()))
            added = tuple(from_hex(k) for k in entry.get("added", ()))
            keys = book.keys
            for k in removed:
                keys.pop(k, None)
            for k in added:
                keys[k] = None
                keys.move_to_end(k)
            over = len(keys) - self.max_keys
            dropped: list[int] = []
            for _ in range(max(over, 0)):
                dropped.append(keys.popitem(last=False)[0])
            book.dropped += len(dropped)
            self.applied += 1
            self.revision += 1
            self.changes.append(Change(self.revision, rid, reset, added, removed + tuple(dropped)))
        self._changed()

    def _changed(self) -> None:
        for listener in self.listeners:
            listener()

    def forget(self, replica_id: str) -> None:
        """The replica left the book (or its node's stream): its keys go, and readers are told."""
        if self.replicas.pop(replica_id, None) is not None:
            self.revision += 1
            self.changes.append(Change(self.revision, replica_id, True, (), ()))
            self._changed()

    def since(self, after: int, epoch: str | None,
              max_keys: int = MAX_KEYS_PER_ANSWER) -> tuple[int, bool, list[dict[str, Any]]]:
        """What a reader at revision ``after`` of book ``epoch`` lacks: ``(revision, full, replicas)``.

        Deltas from the change log when it still holds every change after ``after``; otherwise
        (another epoch, a reader further behind than the log keeps) ``full``: every replica's keys
        with a reset. At most ``max_keys`` keys of deltas per answer (the returned revision is the
        last change included; the reader asks again from there); a full answer is bounded by the
        per-replica cap instead.
        """
        oldest = self.changes[0].revision if self.changes else self.revision + 1
        if epoch != self.epoch or after > self.revision or after < oldest - 1:
            return self.revision, True, [{"replica_id": rid, "reset": True, "added": [to_hex(k) for k in b.keys]}
                                         for rid, b in self.replicas.items()]
        out: list[dict[str, Any]] = []
        revision, keys = after, 0
        for c in islice(self.changes, after - oldest + 1, None):  # revisions are consecutive
            if keys and keys + len(c.added) + len(c.removed) > max_keys:
                break
            entry: dict[str, Any] = {"replica_id": c.replica_id}
            if c.reset:
                entry["reset"] = True
            if c.removed:
                entry["removed"] = [to_hex(k) for k in c.removed]
            if c.added:
                entry["added"] = [to_hex(k) for k in c.added]
            out.append(entry)
            keys += len(c.added) + len(c.removed)
            revision = c.revision
        return revision, False, out

    def view(self, replica_id: str, now: float) -> dict[str, Any] | None:
        """What ``GET /v1/replicas`` and ``ctl replicas`` show of a replica's route keys (None: none reported)."""
        b = self.replicas.get(replica_id)
        if b is None:
            return None
        return {"keys": len(b.keys), "resets": b.resets, "dropped": b.dropped,
                "age_s": None if b.updated_at is None else round(max(0.0, now - b.updated_at), 3)}

    def sizes(self) -> dict[str, int]:
        return {rid: len(b.keys) for rid, b in self.replicas.items()}
