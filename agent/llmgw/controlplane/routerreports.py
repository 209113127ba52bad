"""Routers' ejection reports, judged once a pass: a replica the routers agree is sick is replaced.

The rules are ``ejections`` (pure); this keeps what they work on between
passes (the reports, the last verdicts, the replacements made) and bounds
the replacements with their own limiter.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from llmgw.controlplane.ejections import EjectionBook, Verdict, held, judge
from llmgw.controlplane.lifecycle import ReplacementLimiter
from llmgw.controlplane.replicas import ReplicaBook, ReplicaState
from llmgw.settings import EjectionPolicy

log = logging.getLogger("llmgw.controlplane")


class RouterReports:
    def __init__(self, replacements_per_minute: float):
        self.book = EjectionBook()  # routers' reports (POST /v1/router/ejections), rebuilt from re-sends
        self.verdicts: dict[str, Verdict] = {}  # replica -> the last judgement of its reports
        self.replaced = 0  # replicas judged sick from routers' reports (a counter)
        self.limiter = ReplacementLimiter(replacements_per_minute)

    @property
    def pending(self) -> bool:
        """Whether a pass has anything to judge (reports, or verdicts that may lapse)."""
        return bool(self.book.reports or self.verdicts)

    def watching(self, router: str, now: float) -> None:
        """A router certificate polled the endpoint watch: it counts towards the routers that watch."""
        self.book.watched(router, now)

    def report(self, router: str, entries: list[dict[str, Any]], now: float, instance: str = "") -> None:
        """A validated ejection report from one worker (``instance``) of the router certificate ``router``."""
        self.book.observe(router, entries, now, instance)

    def judge(self, replicas: ReplicaBook, mark_sick: Callable[[str, str], bool], policy: EjectionPolicy,
              now: float) -> bool:
        """Reports -> verdicts; a replica judged sick is marked (``mark_sick``). True when one was."""
        self.book.expire(now, policy.report_ttl)
        verdicts: dict[str, Verdict] = {}
        marked = False
        for rid in list(self.book.reports):
            r = replicas.replicas.get(rid)
            if r is None or r.retired:
                self.book.forget(rid)
                continue
            # an adopted replica was Ready before this control plane started: when is not known here
            v = judge(self.book, rid, None if r.adopted else r.ready_since, now, policy)
            act = v.sick and r.state is ReplicaState.READY and r.surge_for is None and r.sick is None
            if act and not self.limiter.available(now):  # the shared bound: judged again next pass
                v, act = held(v, policy, len(self.limiter.made)), False
            verdicts[rid] = v
            if rid not in self.verdicts or self.verdicts[rid].reason != v.reason:
                log.log(logging.WARNING if v.sick else logging.INFO, "%s: %s", rid, v.reason)
            if act and mark_sick(rid, v.reason):
                self.limiter.take(now)
                self.replaced += 1
                log.warning("%s: judged sick (%s); replacing it, make before break", rid, v.reason)
                marked = True
        self.verdicts = verdicts
        return marked
