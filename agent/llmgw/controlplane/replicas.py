"""Replicas and their shards as the control plane believes them to be.

Nothing here is persisted.  After a restart the book is rebuilt from what
agents report, because only the fleet knows what really runs: a row that
says "running" can describe a process that died, a report cannot.

A shard holds its GPUs from the moment a ``start`` is dispatched until the
agent says it is gone (``stopped``/``failed``, or by not reporting it after
a registration).  ``ReplicaBook.claimed`` is the single answer to "which
GPUs of this node are taken", and placement only ever sees the rest.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from llmgw.catalog import Model, Profile
from llmgw.protocol import ReplicaState, ShardState

# States an agent reports (the wire's ShardState), as the plain strings shards hold; each
# taken by name, so a reordered or extended enum cannot shift one name onto another's value.
PENDING = ShardState.PENDING.value
FETCHING = ShardState.FETCHING.value
STARTING = ShardState.STARTING.value
READY = ShardState.READY.value
FAILED = ShardState.FAILED.value
DRAINING = ShardState.DRAINING.value
STOPPED = ShardState.STOPPED.value
ENDED_STATES = frozenset(s.value for s in ShardState if s.terminal)
RUNNING_STATES = frozenset(s.value for s in ShardState if not s.terminal)
# Control-plane-only shard states: not yet sent to an agent (a worker rank
# waits for rank 0's rendezvous port), or not reported by its agent.
WAITING, GONE = "waiting", "gone"


def model_to_dict(m: Model) -> dict[str, Any]:
    d = {"name": m.name, "source": m.source, "served_name": m.served_name,
         "size_bytes": m.size_bytes, "sha256": m.sha256, "max_model_len": m.max_model_len}
    if m.hub_endpoint is not None:  # only when set: an agent that predates it refuses the key
        d["hub_endpoint"] = m.hub_endpoint
    return d


def profile_to_dict(p: Profile) -> dict[str, Any]:
    d = {"name": p.name, "engine": p.engine, "tensor_parallel_size": p.tensor_parallel_size,
         "pipeline_parallel_size": p.pipeline_parallel_size, "nodes": p.nodes,
         "extra_args": list(p.extra_args), "env": dict(p.env), "start_timeout": p.start_timeout,
         "max_concurrency": p.max_concurrency}
    if p.kv_events:  # only when set: an agent that predates it refuses the key
        d["kv_events"] = True
    if p.kv_transfer is not None:  # only when set, likewise
        d["kv_transfer"] = p.kv_transfer.to_dict()
    return d


def _normal(d: dict[str, Any], template: dict[str, Any]) -> dict[str, Any]:
    # Optional keys may be absent or null on the wire; both mean "not set".
    return {k: d.get(k) for k in template}


def spec_matcher(model: Model, profile: Profile) -> Callable[[dict[str, Any]], bool]:
    """Whether a running shard's spec is what the catalog declares now (one catalog entry, many shards)."""
    want_m, want_p = model_to_dict(model), profile_to_dict(profile)

    def matches(spec: dict[str, Any]) -> bool:
        got_p = _normal(spec.get("profile", {}), want_p)
        got_p["extra_args"] = list(got_p["extra_args"] or [])
        got_p["env"] = dict(got_p["env"] or {})
        # absent means off, so the template alone would miss a profile that turned kv_events off
        got_p["kv_events"] = bool(spec.get("profile", {}).get("kv_events"))
        return _normal(spec.get("model", {}), want_m) == want_m and got_p == {**want_p, "kv_events": profile.kv_events}

    return matches


def spec_matches(spec: dict[str, Any], model: Model, profile: Profile) -> bool:
    """Whether a running shard's spec is what the catalog declares now."""
    return spec_matcher(model, profile)(spec)


def new_replica_id(model: str, profile: str, slot: int, rand: Callable[[], str] | None = None) -> str:
    """``<model>.<profile>.<slot>-<random>``: the slot is stable across restarts, the suffix is not."""
    suffix = rand() if rand else secrets.token_hex(3)
    return f"{model}.{profile}.{slot}-{suffix}"


_SLOT_RE = re.compile(r"(\d{1,6})-[A-Za-z0-9]+")


def slot_of(replica_id: str, model: str, profile: str) -> int | None:
    """The slot encoded in a replica id of this model/profile, if it is one of ours."""
    prefix = f"{model}.{profile}."
    if not replica_id.startswith(prefix):
        return None
    m = _SLOT_RE.fullmatch(replica_id[len(prefix):])
    return int(m.group(1)) if m else None


def shard_id(replica_id: str, rank: int) -> str:
    return f"{replica_id}/r{rank}"


@dataclass
class Shard:
    shard_id: str
    replica_id: str
    rank: int
    node_id: str | None  # None only for a rank of an adopted replica nobody reported yet
    gpu_indices: tuple[int, ...]
    spec: dict[str, Any]
    state: str = WAITING
    reason: str | None = None
    output_tail: str | None = None
    process: dict[str, Any] | None = None
    port: int | None = None
    master_port: int | None = None
    side_port: int | None = None  # a prefill/decode replica's KV-transfer side channel (SGLang: its bootstrap)
    address: str | None = None
    scheme: str = "http"  # "https": rank 0 serves TLS with its node's engine certificate
    engine_version: str | None = None  # what rank 0 says it is (the agent reads it once after Ready)
    sleeping: bool = False  # rank 0's engine is asleep (scale to sleep): Ready, but takes no traffic now
    # Whether an agent's report on its current stream said if rank 0 sleeps: after a restart of the agent or
    # of the control plane nobody knows until the agent has asked the engine, and nothing is slept or woken
    # on a guess (autoscale_sleep).
    sleep_known: bool = False
    adopted: bool = False
    dispatched_at: float | None = None
    state_since: float = 0.0
    progress: dict[str, Any] | None = None
    stop_epoch: int | None = None  # epoch of the node's stream a stop/drain was sent on
    drain_epoch: int | None = None

    @property
    def released(self) -> bool:
        """No longer holds its GPUs: ended, or vanished from its agent's report.

        A worker rank still waiting to be dispatched does hold them: they are
        promised to it, and handing them to another replica meanwhile would be
        handing them out twice.
        """
        return self.state in ENDED_STATES or self.state == GONE

    @property
    def on_node(self) -> bool:
        """Sent to (or reported by) its node and not ended: the agent should know it."""
        return self.node_id is not None and not self.released and self.state != WAITING


@dataclass
class Replica:
    replica_id: str
    model: str
    profile: str
    nnodes: int
    slot: int | None
    shards: dict[int, Shard]  # by rank
    created_at: float
    adopted: bool = False
    failed_at: float | None = None
    failure: str | None = None
    retired: bool = False
    retire_reason: str | None = None
    retired_at: float | None = None
    draining: bool = False
    ready_since: float | None = None
    placement_detail: str | None = None
    restarts: int = 0  # failures of this slot before this replica was placed
    surge_for: str | None = None  # a node drain's replacement for this replica, until it is Ready
    sick: str | None = None  # judged sick while it looks Ready (routers' ejections): replaced make before break

    @property
    def key(self) -> str:
        return f"{self.model}/{self.profile}"

    @property
    def complete(self) -> bool:
        return all(r in self.shards and self.shards[r].node_id is not None for r in range(self.nnodes))

    @property
    def state(self) -> ReplicaState:
        if self.retired:
            return ReplicaState.DRAINING if self.draining else ReplicaState.STOPPING
        if self.failed_at is not None:
            return ReplicaState.FAILED
        if self.complete and all(self.shards[r].state == READY for r in range(self.nnodes)):
            return ReplicaState.READY
        return ReplicaState.STARTING

    @property
    def all_released(self) -> bool:
        return all(s.released for s in self.shards.values())

    def nodes(self) -> set[str]:
        return {s.node_id for s in self.shards.values() if s.node_id is not None}


@dataclass
class SlotHistory:
    """Restart bookkeeping for one slot of one deployment (``model/profile#slot``)."""

    failures: int = 0
    next_attempt_at: float = 0.0
    last_failure: dict[str, Any] | None = None  # {replica_id, reason, output_tail, at}
    needs_replacement_token: bool = False  # its last replica was on a lost node


@dataclass
class ReplicaBook:
    """Every replica and stray shard, indexed by node.

    At fleet size the questions asked most ("which GPUs of this node are
    taken", "which shard is this report about") must not walk every shard
    of the fleet, so shards are indexed by node as they enter and leave the
    book.  Hence the rule: replicas and strays are added and removed only
    through ``add``/``remove``/``set_shard``/``add_stray``/``remove_stray``
    (a shard's ``node_id`` never changes once it is in the book).
    """

    replicas: dict[str, Replica] = field(default_factory=dict)
    # Shards running on a node that belong to no replica we keep: stopped, and
    # their GPUs counted as taken until the agent says they are gone.
    strays: dict[tuple[str, str], Shard] = field(default_factory=dict)
    slots: dict[tuple[str, int], SlotHistory] = field(default_factory=dict)
    _on_node: dict[str, dict[str, Shard]] = field(default_factory=dict, repr=False, compare=False)
    _strays_on: dict[str, dict[str, Shard]] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.reindex()

    # ------------------------------------------------------------- mutation
    def reindex(self) -> None:
        """Rebuild the node index from scratch (construction, and tests that check it)."""
        self._on_node, self._strays_on = {}, {}
        for r in self.replicas.values():
            for s in r.shards.values():
                self._index(s)
        for (node_id, sid), s in self.strays.items():
            self._strays_on.setdefault(node_id, {})[sid] = s

    def _index(self, s: Shard) -> None:
        if s.node_id is not None:
            self._on_node.setdefault(s.node_id, {})[s.shard_id] = s

    def _unindex(self, s: Shard) -> None:
        on = self._on_node.get(s.node_id) if s.node_id is not None else None
        if on is not None and on.get(s.shard_id) is s:
            del on[s.shard_id]
            if not on:
                del self._on_node[s.node_id]  # type: ignore[arg-type]

    def add(self, r: Replica) -> None:
        self.replicas[r.replica_id] = r
        for s in r.shards.values():
            self._index(s)

    def remove(self, replica_id: str) -> None:
        r = self.replicas.pop(replica_id)
        for s in r.shards.values():
            self._unindex(s)

    def set_shard(self, r: Replica, rank: int, s: Shard) -> None:
        old = r.shards.get(rank)
        if old is not None:
            self._unindex(old)
        r.shards[rank] = s
        if self.replicas.get(r.replica_id) is r:
            self._index(s)

    def add_stray(self, s: Shard) -> None:
        assert s.node_id is not None
        self.strays[(s.node_id, s.shard_id)] = s
        self._strays_on.setdefault(s.node_id, {})[s.shard_id] = s

    def remove_stray(self, key: tuple[str, str]) -> None:
        del self.strays[key]
        on = self._strays_on[key[0]]
        del on[key[1]]
        if not on:
            del self._strays_on[key[0]]

    # -------------------------------------------------------------- queries
    def all_shards(self) -> Iterator[Shard]:
        for r in self.replicas.values():
            yield from r.shards.values()
        yield from self.strays.values()

    def shards_on(self, node_id: str) -> list[Shard]:
        """Replica shards on the node, then strays there."""
        return [*self._on_node.get(node_id, {}).values(), *self._strays_on.get(node_id, {}).values()]

    def replica_ids_on(self, node_id: str) -> set[str]:
        """The replicas with a shard on ``node_id`` (strays are no replica's)."""
        return {s.replica_id for s in self._on_node.get(node_id, {}).values()}

    def find(self, node_id: str, sid: str) -> Shard | None:
        """The shard ``sid`` as believed to run on ``node_id`` (None if elsewhere or unknown)."""
        s = self._on_node.get(node_id, {}).get(sid)
        return s if s is not None else self.strays.get((node_id, sid))

    def claimed(self, node_id: str) -> dict[int, str]:
        """GPU index -> shard id holding it, on ``node_id``."""
        out: dict[int, str] = {}
        for s in self.shards_on(node_id):
            if not s.released:
                for g in s.gpu_indices:
                    out.setdefault(g, s.shard_id)
        return out

    def double_claims(self) -> list[tuple[str, int, list[str]]]:
        """(node, gpu, shard ids) for every GPU more than one live shard holds."""
        out = []
        for node_id in self._on_node.keys() | self._strays_on.keys():
            shards = self.shards_on(node_id)
            if len(shards) < 2:
                continue  # the common case at fleet size: nothing to compare
            seen: dict[int, list[str]] = {}
            for s in shards:
                if not s.released:
                    for g in s.gpu_indices:
                        seen.setdefault(g, []).append(s.shard_id)
            out.extend((node_id, g, ids) for g, ids in seen.items() if len(ids) > 1)
        return sorted(out)

    def slot(self, key: str, slot: int) -> SlotHistory:
        return self.slots.setdefault((key, slot), SlotHistory())

    def settled(self) -> bool:
        """Nothing in flight: every replica serving, none retired or failed, no strays."""
        return not self.strays and all(r.state is ReplicaState.READY for r in self.replicas.values())

    def live(self) -> list[Replica]:
        return [r for r in self.replicas.values() if not r.retired]
