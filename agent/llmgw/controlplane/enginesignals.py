"""The engines' own signals as agents report them, aggregated per deployment for the autoscaler.

Deployments with ``autoscale.signal: queue_depth`` or ``kv_cache_use`` scale on
what their engines say, read by each node's agent (``agent/enginesignals``) and
sent on its stream as ``engine_signals``: only values that moved beyond a dead
band, everything once a refresh.  This book keeps each replica's last value with
the stream and the time it came on, and makes one sample per deployment:

- a value counts while the stream that carried it is the node's current one and
  it is no older than ``stale_after`` (the refresh plus two periods: an agent that
  stopped reading, or whose engine stopped answering, is not believed for long);
- only Ready replicas count (a draining one finishes its own queue; one starting
  has none yet), and a Ready replica without a value that counts makes the sample
  *partial*: the autoscaler then takes no sample and its count holds, as for a
  silent router (``routerload``), so a gap never reads as an idle engine;
- the sample is the sum over the replicas (the rule wants ``ceil(sum / target)``,
  a target per replica): requests waiting, or KV-cache fractions.

A report is believed only for a rank-0 shard this control plane books on the
node whose stream carried it (``owner``), as for route keys.  Also here: what
each node is asked to read (``wanted``), and the period, stretched so that a
large fleet sends at most ``max_per_second`` messages (``period``).

Pure: explicit times, no I/O (``state`` feeds it and sends what ``Asked`` decides).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from llmgw.catalog import Catalog
from llmgw.controlplane.replicas import ReplicaBook, ReplicaState
from llmgw.enginesignals import ENGINE_SIGNALS

MAX_SHARDS = 256  # rank-0 shards named to one node (the stream schema's bound)
REFRESH_PERIODS = 6  # every value is sent again at least this many periods apart
STALE_PERIODS = 2  # ... and counts for this many periods past its refresh


@dataclass(frozen=True)
class Timing:
    period: float  # seconds between an agent's reads of each engine
    refresh: float  # seconds after which an agent sends every value again
    stale_after: float  # seconds a value counts for without being sent again


def timing(base: float, max_per_second: float, nodes: int) -> Timing:
    """The period for ``nodes`` asked to report: ``base``, doubled until the fleet sends at most
    ``max_per_second`` messages even if every value moved every period.  Doubling, not dividing:
    a period that moved with every node placed would be sent to every node again each time."""
    period = base
    while nodes / period > max_per_second:
        period *= 2
    refresh = REFRESH_PERIODS * period
    return Timing(period, refresh, refresh + STALE_PERIODS * period)


@dataclass(frozen=True)
class Value:
    node_id: str
    epoch: int  # the node's stream it came on
    signal: str
    value: float | None  # None: the agent could not read it
    at: float


@dataclass(frozen=True)
class Sample:
    """One deployment's signal now: ``total`` over its Ready replicas, None unless every one reported."""

    signal: str
    total: float | None
    reporting: int  # Ready replicas with a value that counts
    replicas: int  # Ready replicas

    @property
    def partial(self) -> bool:
        return self.reporting < self.replicas


class SignalBook:
    def __init__(self, owner: Callable[[str, str], str | None]) -> None:
        """``owner(node_id, shard_id)``: the replica whose rank 0 that is, booked on that node; else None."""
        self.owner = owner
        self.values: dict[str, Value] = {}  # replica id -> its last value
        self.messages = 0  # engine_signals messages applied
        self.refused = 0  # entries for a shard the node does not run as a rank 0

    def apply(self, node_id: str, epoch: int, msg: Mapping[str, Any], now: float) -> None:
        """A validated ``engine_signals`` from ``node_id``'s current stream (``epoch``), received at ``now``."""
        self.messages += 1
        for e in msg["shards"]:
            rid = self.owner(node_id, e["shard_id"])
            if rid is None:
                self.refused += 1
                continue
            v = e["value"]
            self.values[rid] = Value(node_id, epoch, e["signal"], None if v is None else float(v), now)

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the values of replicas not in ``keep`` (gone from the book)."""
        keep = set(keep)
        for rid in [r for r in self.values if r not in keep]:
            del self.values[rid]

    def samples(self, catalog: Catalog, book: ReplicaBook, now: float, stale_after: float,
                current: Callable[[str, int], bool]) -> dict[str, Sample]:
        """A sample per deployment that autoscales on an engine signal (``current(node, epoch)``: that
        stream is the node's live one)."""
        signals = {d.key: d.autoscale.signal for d in catalog.deployments
                   if d.autoscale is not None and d.autoscale.signal in ENGINE_SIGNALS}
        if not signals:
            return {}
        sums = {key: [0.0, 0, 0] for key in signals}  # total, reporting, replicas
        for r in book.replicas.values():
            acc = sums.get(r.key)
            if acc is None or r.state is not ReplicaState.READY:
                continue
            acc[2] += 1
            v = self.values.get(r.replica_id)
            if (v is not None and v.value is not None and v.signal == signals[r.key]
                    and now - v.at <= stale_after and current(v.node_id, v.epoch)):
                acc[0] += v.value
                acc[1] += 1
        return {key: Sample(signals[key], total if 0 < reporting == n else None, reporting, n)
                for key, (total, reporting, n) in sums.items()}


def wanted(catalog: Catalog, book: ReplicaBook) -> dict[str, tuple[tuple[str, str, float], ...]]:
    """Per node, the rank-0 shards to read: (shard id, signal, dead band), for every replica not retired of
    a deployment on an engine signal. The dead band is the rule's own tolerance of a replica's target:
    errors that small, summed over the replicas, stay within the count's dead band."""
    policies = {d.key: d.autoscale for d in catalog.deployments
                if d.autoscale is not None and d.autoscale.signal in ENGINE_SIGNALS}
    out: dict[str, list[tuple[str, str, float]]] = {}
    if not policies:
        return {}
    for r in book.replicas.values():
        p = policies.get(r.key)
        s = r.shards.get(0)
        if p is None or r.retired or s is None or not s.on_node:
            continue
        out.setdefault(s.node_id, []).append((s.shard_id, p.signal, p.tolerance * p.target))  # type: ignore[arg-type]
    return {n: tuple(sorted(v)) for n, v in out.items()}


class Asked:
    """What each node's current stream has been told to read; ``messages`` says whom to tell what now.

    A stream starts told nothing (its agent reads nothing until asked), so a node with nothing to read
    is sent nothing; one told something is told again when that changes (or the period does), an
    empty list included, after which it is as if never asked.
    """

    def __init__(self) -> None:
        self.told: dict[str, tuple[int, float, tuple[tuple[str, str, float], ...]]] = {}

    def messages(self, want: Mapping[str, tuple[tuple[str, str, float], ...]], epochs: Mapping[str, int],
                 t: Timing) -> list[tuple[str, dict[str, Any]]]:
        """(node id, ``engine_signals_wanted``) for every connected node (``epochs``) whose ask changed."""
        for node in [n for n in self.told if n not in epochs]:
            del self.told[node]
        out = []
        for node, epoch in epochs.items():
            shards = want.get(node, ())
            before = self.told.get(node)
            if before is not None and before[0] == epoch and before[2] == shards and (before[1] == t.period
                                                                                     or not shards):
                continue
            if not shards and (before is None or before[0] != epoch):
                continue  # never asked on this stream: it reads nothing already
            if shards:
                self.told[node] = (epoch, t.period, shards)
            else:
                del self.told[node]  # told to stop: as good as never asked
            out.append((node, {"type": "engine_signals_wanted", "period": t.period, "refresh": t.refresh,
                               "shards": [{"shard_id": sid, "signal": sig, "deadband": round(band, 6)}
                                          for sid, sig, band in shards[:MAX_SHARDS]]}))
        return out
