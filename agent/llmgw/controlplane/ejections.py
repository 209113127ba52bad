"""Routers' ejection reports, and the judgement they feed: pure, clock passed in.

A router ejects an engine that fails its requests, but it sees the engine
over one network path: a router with a broken route, a full conntrack table
or a bad NIC ejects engines that serve everyone else.  So one router's
report never replaces a replica; it is kept and shown.  A replica is judged
sick only when

* at least ``min_routers`` distinct routers (certificate names) report it,
  and at least ``min_share`` of the routers currently watching the endpoint
  set, each continuously for ``sick_after`` seconds; and
* the time counted starts at the first report of the episode that *this*
  control plane received: how long a router says its episode has lasted is
  its word, not evidence, and taken at its word two router certificates
  claiming an hour had a healthy replica replaced on their first report.
  A router's claim can only shorten the count (an episode that started
  over), never lengthen it.  After a control-plane restart the count starts
  over from the next reports: ``sick_after`` later, not never.
* and no earlier than the replica became Ready: the agent's readiness probe
  (a real completion) passing is newer evidence than an ejection from
  before it.

Reports are re-sent by routers every few seconds while the ejection lasts;
a report not renewed for ``report_ttl`` seconds is forgotten (the router
recovered or went away), and its episode with it.  Replacements these
judgements cause share their own bound (``replacements_per_minute``, in the
control plane), so a flood of reports, honest or not, cannot replace the
fleet at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from llmgw.settings import EjectionPolicy

WATCHER_TTL = 75.0  # a router long-polls the watch every <= 30 s (45 s read timeout); seen within this, it watches


@dataclass
class Report:
    """One router's current report about one replica."""

    router: str
    replica_id: str
    endpoint_id: str
    reason: str
    since: float  # control-plane clock: when the router says its episode began (its word only)
    consecutive_failures: int
    ejected_now: bool
    last_seen: float
    first_seen: float = -math.inf  # control-plane clock: this control plane's first report of the episode

    @property
    def counted_from(self) -> float:
        """Where ``sick_after`` counts from: the first report seen here, or later if the router says so."""
        return max(self.since, self.first_seen)

    def view(self, now: float) -> dict[str, Any]:
        return {"router": self.router, "endpoint_id": self.endpoint_id, "reason": self.reason,
                "ejected_for_s": round(max(0.0, now - self.since), 3),
                "counted_for_s": round(max(0.0, now - self.counted_from), 3),
                "consecutive_failures": self.consecutive_failures, "ejected_now": self.ejected_now,
                "reported_ago_s": round(max(0.0, now - self.last_seen), 3)}


@dataclass(frozen=True)
class Verdict:
    sick: bool
    reason: str  # why sick, or why not (yet)
    routers: tuple[str, ...]  # routers reporting it now
    needed: int  # distinct routers it takes


@dataclass
class EjectionBook:
    """What routers report now, and which routers watch; forgotten on restart (routers re-send).

    A router with several workers reports once per worker (``instance``), each
    with its own episode; the router counts once, with its longest episode.
    """

    # replica -> router -> worker instance -> report
    reports: dict[str, dict[str, dict[str, Report]]] = field(default_factory=dict)
    watchers: dict[str, float] = field(default_factory=dict)  # router -> last seen (watch or report)
    received: dict[str, int] = field(default_factory=dict)  # router -> reports received (a counter)

    def watched(self, router: str, now: float) -> None:
        self.watchers[router] = now

    def observe(self, router: str, entries: list[dict[str, Any]], now: float, instance: str = "") -> None:
        """One validated report from one worker of ``router``: renew or start each entry's record."""
        self.received[router] = self.received.get(router, 0) + 1
        self.watched(router, now)
        for e in entries:
            workers = self.reports.setdefault(e["replica_id"], {}).setdefault(router, {})
            known = workers.get(instance)
            workers[instance] = Report(router, e["replica_id"], e["endpoint_id"], e["reason"],
                                       now - float(e["ejected_for_s"]), int(e["consecutive_failures"]),
                                       bool(e.get("ejected_now", True)), now,
                                       first_seen=now if known is None else known.first_seen)

    def expire(self, now: float, ttl: float) -> None:
        for rid in list(self.reports):
            per = self.reports[rid]
            for router in list(per):
                workers = per[router]
                for inst in [i for i, rep in workers.items() if now - rep.last_seen > ttl]:
                    del workers[inst]
                if not workers:
                    del per[router]
            if not per:
                del self.reports[rid]
        for router in [r for r, t in self.watchers.items() if now - t > WATCHER_TTL]:
            del self.watchers[router]

    def forget(self, replica_id: str) -> None:
        self.reports.pop(replica_id, None)

    def for_replica(self, replica_id: str, now: float | None = None, ttl: float | None = None) -> list[Report]:
        """One report per router (its longest counted episode), by router name; only fresh ones with ``now``/``ttl``."""
        out = []
        for router, workers in sorted(self.reports.get(replica_id, {}).items()):
            fresh = [rep for rep in workers.values()
                     if now is None or ttl is None or now - rep.last_seen <= ttl]
            if fresh:
                out.append(min(fresh, key=lambda rep: rep.counted_from))
        return out

    def watching(self) -> int:
        return len(self.watchers)


def routers_needed(policy: EjectionPolicy, watching: int) -> int:
    """Distinct routers it takes to judge a replica sick with ``watching`` routers watching."""
    return max(policy.min_routers, math.ceil(policy.min_share * watching - 1e-9))


def judge(book: EjectionBook, replica_id: str, ready_since: float | None, now: float,
          policy: EjectionPolicy) -> Verdict:
    """Whether routers' reports say ``replica_id`` is sick (see the module's rules).

    ``ready_since``: when this control plane saw the replica's readiness probe
    pass; None when it does not know (a replica it adopted after a restart was
    Ready before it started), and then the count starts at the first report.
    """
    reports = book.for_replica(replica_id, now, policy.report_ttl)
    routers = tuple(r.router for r in reports)
    needed = routers_needed(policy, book.watching())
    if not reports:
        return Verdict(False, "no router reports it", routers, needed)
    start = ready_since if ready_since is not None else float("-inf")
    long_enough = [r for r in reports if now - max(r.counted_from, start) >= policy.sick_after]
    if len(reports) < needed:
        return Verdict(False, f"ejected by {len(reports)} router(s) ({', '.join(routers)}); it takes {needed} "
                              f"distinct routers to replace a replica, so one router's network path cannot",
                       routers, needed)
    if len(long_enough) < needed:
        return Verdict(False, f"ejected by {len(reports)} router(s) ({', '.join(routers)}); waiting until "
                              f"{needed} of them have ejected it for {policy.sick_after:g}s", routers, needed)
    failures = sum(r.consecutive_failures for r in long_enough)
    reasons = ", ".join(sorted({r.reason for r in long_enough}))
    return Verdict(True, f"ejected by {len(long_enough)} routers ({', '.join(r.router for r in long_enough)}) for "
                         f"over {policy.sick_after:g}s ({reasons}; {failures} failed requests in a row)",
                   routers, needed)


def held(v: Verdict, policy: EjectionPolicy, made: int) -> Verdict:
    """A sick verdict the replacement bound holds back for now (it is judged again on the next pass)."""
    return Verdict(True, f"{v.reason}; held: {made} replica(s) replaced for routers' ejections in the last "
                         f"minute, router_ejections.replacements_per_minute is {policy.replacements_per_minute}",
                   v.routers, v.needed)
