"""The router's index of route keys: which replica's engine holds which prompt prefix.

Fed by the endpoint watch (``route_keys`` in its answers, ``llmgw.router.watch``): the control
plane's per-replica sets of route keys (``llmgw.kvroutekeys``), which agents compute on the node
from their engines' KV events. Bounded per replica (``max_keys``, the oldest dropped), like the
control plane's own book.

A replica's entry is **fresh** only while the watch keeps answering: after ``stale_after``
seconds without an answer (the control plane away, a partition) nothing says what the engines
evicted meanwhile, and a stale index would send prompts to replicas that no longer hold their
prefix. So a scorer asks ``fresh`` and falls back to approximate prefix affinity for a replica
that is not: stale, or with no entry at all (an engine that publishes nothing, llama.cpp; a
control plane that predates route keys).

Pure logic: the clock is passed in.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from llmgw.kvroutekeys import from_hex

DEFAULT_MAX_KEYS = 1 << 17  # per replica, as the control plane keeps
DEFAULT_STALE_AFTER = 90.0  # three long polls without an answer


class KVIndexError(ValueError):
    """A ``route_keys`` answer that is not what the control plane sends; the message says where."""


@dataclass
class ReplicaIndex:
    keys: OrderedDict[int, None] = field(default_factory=OrderedDict)


class KVIndex:
    def __init__(self, max_keys: int = DEFAULT_MAX_KEYS, stale_after: float = DEFAULT_STALE_AFTER) -> None:
        self.max_keys = max_keys
        self.stale_after = stale_after
        self.replicas: dict[str, ReplicaIndex] = {}
        self.epoch: str = ""
        self.revision = -1
        self.synced_at: float | None = None  # when the watch last answered

    # ------------------------------------------------------------------ feeding
    def apply(self, doc: Any, now: float) -> None:
        """One watch answer's ``route_keys``; raises ``KVIndexError`` (changing nothing) when malformed."""
        epoch, revision, full, entries = _parse(doc)
        if full:
            self.replicas.clear()
        for rid, reset, removed, added in entries:
            rep = self.replicas.get(rid)
            if rep is None:
                rep = self.replicas[rid] = ReplicaIndex()
            if reset:
                rep.keys.clear()
            for k in removed:
                rep.keys.pop(k, None)
            for k in added:
                rep.keys[k] = None
                rep.keys.move_to_end(k)
            while len(rep.keys) > self.max_keys:
                rep.keys.popitem(last=False)
        self.epoch, self.revision = epoch, revision
        self.synced_at = now

    def answered(self, now: float) -> None:
        """The watch answered (with or without changes): the index is current as of ``now``."""
        self.synced_at = now

    def forget_except(self, replica_ids: set[str]) -> None:
        """Drop replicas no longer in the endpoint set."""
        for rid in [r for r in self.replicas if r not in replica_ids]:
            del self.replicas[rid]

    # ------------------------------------------------------------------ reading
    def fresh(self, replica_id: str, now: float) -> bool:
        """Whether the index speaks for this replica now (else: fall back to approximate affinity)."""
        return (replica_id in self.replicas and self.synced_at is not None
                and now - self.synced_at <= self.stale_after)

    def held_prefix(self, replica_id: str, keys: Sequence[int]) -> int:
        """How many of ``keys`` (a request's chained block keys) the replica holds, from the first on."""
        rep = self.replicas.get(replica_id)
        if rep is None:
            return 0
        held = rep.keys
        n = 0
        for k in keys:
            if k not in held:
                break
            n += 1
        return n

    def sizes(self) -> dict[str, int]:
        return {rid: len(r.keys) for rid, r in self.replicas.items()}


def _parse(doc: Any) -> tuple[str, int, bool, list[tuple[str, bool, list[int], list[int]]]]:
    if not isinstance(doc, Mapping):
        raise KVIndexError(f"/route_keys: expected an object, got {type(doc).__name__}")
    epoch, revision, full, raw = doc.get("epoch"), doc.get("revision"), doc.get("full", False), doc.get("replicas")
    if not isinstance(epoch, str):
        raise KVIndexError("/route_keys/epoch: expected a string")
    if not isinstance(revision, int) or isinstance(revision, bool):
        raise KVIndexError("/route_keys/revision: expected an integer")
    if not isinstance(full, bool):
        raise KVIndexError("/route_keys/full: expected a boolean")
    if not isinstance(raw, list):
        raise KVIndexError("/route_keys/replicas: expected an array")
    out = []
    for i, e in enumerate(raw):
        where = f"/route_keys/replicas/{i}"
        if not isinstance(e, Mapping) or not isinstance(e.get("replica_id"), str):
            raise KVIndexError(f"{where}: expected an object with a string replica_id")
        lists = []
        for name in ("removed", "added"):
            items = e.get(name, [])
            if not isinstance(items, list):
                raise KVIndexError(f"{where}/{name}: expected an array")
            try:
                lists.append([from_hex(k) for k in items])
            except (TypeError, ValueError) as err:
                raise KVIndexError(f"{where}/{name}: {err}") from None
        out.append((e["replica_id"], e.get("reset") is True, lists[0], lists[1]))
    return epoch, revision, full, out
