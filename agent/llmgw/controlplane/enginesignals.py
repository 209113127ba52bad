"""The engines' own signals as agents report them, aggregated per deployment for the autoscaler.

Deployments with ``autoscale.signal: queue_depth`` or ``kv_cache_use`` scale on
what their engines say, read by each node's agent (``agent/enginesignals``) and
sent on its stream as ``engine_signals``: only values that moved beyond a dead
band, everything once a refresh.  This book keeps each replica's last value with
the stream and the time it came on, and makes one sample per deployment:

- a value counts while the stream that carried it is the node's current one, open, and
  it is no older than ``stale_after`` (the refresh plus two periods: an agent that
  stopped reading, or whose engine stopped answering, is not believed for long),
  both checked once a period;
- agents read Ready replicas only (a draining one finishes its own queue; one
  starting has none yet), and fewer values that count than Ready replicas make
  the sample *partial*: the autoscaler then takes no sample and its count holds, as for a
  silent router (``routerload``), so a gap never reads as an idle engine;
- the sample is the sum over the replicas (the rule wants ``ceil(sum / target)``,
  a target per replica): requests waiting, or KV-cache fractions.

A report is believed only for a rank-0 shard this control plane books on the
node whose stream carried it (``owner``), as for route keys.  What each node is
asked to read, the period and the Ready counts come from ``enginesignals_ask``.

Pure: explicit times, no I/O (``state`` feeds it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from llmgw.controlplane.enginesignals_ask import Timing


@dataclass(frozen=True)
class Value:
    key: str  # the replica's deployment
    node_id: str
    epoch: int  # the node's stream it came on
    signal: str
    value: float | None  # None: the agent could not read it
    at: float


@dataclass(frozen=True)
class Sample:
    """One deployment's signal now: ``total`` over its replicas, None unless every Ready one reported."""

    signal: str
    total: float | None
    reporting: int  # replicas with a value that counts
    replicas: int  # Ready replicas (at least those reporting)

    @property
    def partial(self) -> bool:
        return self.reporting < self.replicas


class SignalBook:
    """Replicas' last values, and per deployment their sum, kept as values arrive.

    A control plane passes once a second over what it holds; walking 80,000 replicas for this on each
    pass cost 180 ms (benchmarks/results/engine-signals.md). So each value moves its deployment's sum
    as it is applied, and values gone stale, sent on a stream that is no longer the node's or of
    replicas gone from the book are dropped by a sweep once a period, which also adds the sums up
    afresh (``sweep``). How many replicas are Ready comes from a walk of the book at most once a period
    (``set_members``), so it may lag: a replica Ready since that reports counts at once (the sample is
    whole when as many report as were Ready), and one that left without a value makes the sample
    partial until the next walk, which holds the count rather than drop it. A pass reads the sums
    (``samples``): as many steps as deployments.
    """

    def __init__(self, owner: Callable[[str, str], str | None], deployment: Callable[[str], str | None]) -> None:
        """``owner(node_id, shard_id)``: the replica whose rank 0 that is, booked on that node, else None;
        ``deployment(replica_id)``: its deployment key, else None."""
        self.owner, self.deployment = owner, deployment
        self.values: dict[str, Value] = {}  # replica id -> its last value
        self.signal: dict[str, str] = {}  # deployment key -> its engine signal
        self.ready: dict[str, int] = {}  # deployment key -> Ready replicas, as the last walk counted
        self.sums: dict[str, list[float]] = {}  # deployment key -> [total, replicas counted]
        self.swept_at = float("-inf")
        self.messages = 0  # engine_signals messages applied
        self.refused = 0  # entries for a shard the node does not run as a rank 0

    def _move(self, v: Value | None, sign: int) -> None:
        if v is not None and v.value is not None and self.signal.get(v.key) == v.signal:
            acc = self.sums[v.key]
            acc[0] += sign * v.value
            acc[1] += sign

    def apply(self, node_id: str, epoch: int, msg: Mapping[str, Any], now: float) -> None:
        """A validated ``engine_signals`` from ``node_id``'s current stream (``epoch``), received at ``now``."""
        self.messages += 1
        for e in msg["shards"]:
            rid = self.owner(node_id, e["shard_id"])
            key = None if rid is None else self.deployment(rid)
            if rid is None or key is None:
                self.refused += 1
                continue
            v = e["value"]
            self._move(self.values.get(rid), -1)
            self.values[rid] = new = Value(key, node_id, epoch, e["signal"], None if v is None else float(v), now)
            self._move(new, +1)

    def set_members(self, members: Mapping[str, tuple[str, int]]) -> None:
        """Per deployment on an engine signal: (its signal, its Ready replicas), as a walk of the book saw."""
        signal = {key: sig for key, (sig, _) in members.items()}
        self.ready = {key: n for key, (_, n) in members.items()}
        if signal != self.signal:
            self.signal = signal
            self._add_up()

    def _add_up(self) -> None:
        self.sums = {key: [0.0, 0] for key in self.signal}
        for v in self.values.values():
            self._move(v, +1)

    def sweep(self, now: float, t: Timing, current: Callable[[str, int], bool], known: Callable[[str], bool]) -> None:
        """Once a period: drop values older than ``t.stale_after``, from a stream no longer current, or of
        replicas the book no longer has (``known``); then add the sums up afresh."""
        if now - self.swept_at < t.period:
            return
        self.swept_at = now
        for rid in [rid for rid, v in self.values.items()
                    if now - v.at > t.stale_after or not current(v.node_id, v.epoch) or not known(rid)]:
            del self.values[rid]
        self._add_up()

    def samples(self) -> dict[str, Sample]:
        """A sample per deployment on an engine signal: the sum when as many replicas count as are Ready."""
        out = {}
        for key, (total, counted) in self.sums.items():
            n, c = self.ready.get(key, 0), int(counted)
            out[key] = Sample(self.signal[key], total if c > 0 and c >= n else None, c, max(n, c))
        return out
