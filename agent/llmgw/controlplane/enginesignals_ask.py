"""What each node is asked to read of its engines' signals, and how often.

The control plane tells each node's agent, in ``engine_signals_wanted``, the
rank-0 shards of deployments on an engine signal that run there, each with
its dead band, and the period and refresh (``controlplane/enginesignals`` keeps
what comes back).  ``walk`` finds them, and how many replicas of each such
deployment are Ready, in one pass over the book; ``Asked`` remembers what each
node's stream was told, so a node is told again only when that changes; and
``timing`` stretches the period so that a large fleet sends at most
``max_engine_signals_per_second`` messages even if every value moved.

Pure: no I/O, no clock (``state`` runs it and sends what ``Asked`` decides).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmgw.catalog import Catalog
from llmgw.controlplane.replicas import READY, ReplicaBook, ReplicaState
from llmgw.enginesignals import ENGINE_SIGNALS

MAX_SHARDS = 256  # rank-0 shards named to one node (the stream schema's bound)
MAX_PERIOD = 3600.0  # seconds: the longest period the stream schema lets an agent be told
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
    while nodes / period > max_per_second and period * 2 <= MAX_PERIOD:
        period *= 2
    refresh = REFRESH_PERIODS * period
    return Timing(period, refresh, refresh + STALE_PERIODS * period)


def walk(catalog: Catalog, book: ReplicaBook) -> tuple[dict[str, tuple[tuple[str, str, float], ...]],
                                                      dict[str, tuple[str, int]]]:
    """One pass over the book for the deployments on an engine signal: per node, the rank-0 shards to read
    (shard id, signal, dead band), every replica not retired; and per deployment, (signal, how many
    replicas are Ready). The dead band is the rule's own tolerance of a replica's target: errors that small,
    summed over the replicas, stay within the count's dead band."""
    policies = {(d.model, d.profile): (d.key, d.autoscale.signal, d.autoscale.tolerance * d.autoscale.target)
                for d in catalog.deployments if d.autoscale is not None and d.autoscale.signal in ENGINE_SIGNALS}
    if not policies:
        return {}, {}
    want: dict[str, list[tuple[str, str, float]]] = {}
    counts: dict[str, int] = {key: 0 for key, _, _ in policies.values()}
    for r in book.replicas.values():  # 80,000 replicas at 10,000 nodes: the properties are spelled out
        p = policies.get((r.model, r.profile))
        if p is None or r.retired:
            continue
        s = r.shards.get(0)
        if s is None or s.node_id is None:
            continue
        ready = s.state == READY
        if ready or s.on_node:
            want.setdefault(s.node_id, []).append((s.shard_id, p[1], p[2]))
        if ready and r.failed_at is None and (r.nnodes == 1 or r.state is ReplicaState.READY):
            counts[p[0]] += 1
    return {n: tuple(sorted(v)) for n, v in want.items()}, {key: (sig, counts[key]) for key, sig, _ in
                                                           policies.values()}


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
