"""The clocks the node lifecycle runs on: the startup grace, the fleet's size, this process's own stalls.

Nodes are judged on silence, so the control plane must not count its own
pauses against them: the lag of its event loop (``looplag``) is added up
and, once it matters, every node's deadlines are pushed back by it before
the lifecycle is evaluated.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from llmgw.controlplane.lifecycle import Evaluation, NodeClock, evaluate, excuse
from llmgw.controlplane.looplag import LoopLag
from llmgw.settings import Lifecycle

log = logging.getLogger("llmgw.controlplane")

STALL_EXCUSED_FROM = 0.25  # seconds of loop lateness, added up, before the nodes' deadlines are pushed back
# The startup grace is held while agents refused by admission are due back, up to this many
# times startup_grace: a restart that cannot admit its fleet within the grace must not judge
# the agents still waiting in line (and re-place their replicas), nor wait forever.
MAX_GRACE_FACTOR = 4.0


class LifecycleTimers:
    def __init__(self, started_at: float):
        self.started_at = started_at  # the startup (or failover) grace counts from here
        self.evaluation = Evaluation()
        self.looplag = LoopLag()  # this process's own stalls, not counted against agents
        self.stalled = 0.0  # seconds of stall excused so far, for logs and tests
        self._stall_owed = 0.0  # loop lateness not yet excused (see excuse_stall)
        self._fleet_size = 0  # the most nodes known at once: sizes the heartbeat interval
        self._refused_due = 0.0  # when the last agents refused during the grace are due back

    def lifecycle(self, configured: Lifecycle) -> Lifecycle:
        """The lifecycle timings in force: the configured ones, stretched for a large fleet.

        Sized by the most nodes this control plane has known at once (nodes
        are never forgotten while it runs), so a timing never shrinks below
        what a node was told when it registered.
        """
        return configured.for_fleet(self._fleet_size)

    def grown_to(self, nodes: int, configured: Lifecycle) -> None:
        if nodes <= self._fleet_size:
            return
        before = self.lifecycle(configured)
        self._fleet_size = nodes
        after = self.lifecycle(configured)
        if after.heartbeat_interval != before.heartbeat_interval:
            log.info("%d nodes: heartbeat every %.1fs (max_heartbeats_per_second %g); unreachable after %.1fs, "
                     "lost after %.1fs", nodes, after.heartbeat_interval,
                     after.max_heartbeats_per_second, after.unreachable_after, after.lost_after)

    def restart(self, now: float) -> None:
        """A new grace from ``now`` (taking the lead): nothing judged before agents have moved over."""
        self.started_at = now
        self._refused_due = 0.0
        self.evaluation = Evaluation()

    def grace_end(self, lc: Lifecycle) -> float:
        """When the startup grace ends: ``startup_grace`` after the start, or later while refused agents are due.

        An agent refused by admission is told a Retry-After and comes back
        within twice that; until the last of them has, a silent node may be
        one still in line, not a dead one.
        """
        base = self.started_at + lc.startup_grace
        if self._refused_due <= base:
            return base
        return min(self._refused_due, self.started_at + MAX_GRACE_FACTOR * lc.startup_grace)

    def grace_left(self, now: float, lc: Lifecycle) -> float:
        return max(0.0, self.grace_end(lc) - now)

    def note_refused(self, now: float, retry_after: float, lc: Lifecycle) -> None:
        """An agent refused admission during the grace holds it until it is due back (``grace_end``).

        Refusals after the grace has ended change nothing: a settled fleet's
        nodes are judged by their silence as always.
        """
        if now < self.grace_end(lc):
            self._refused_due = max(self._refused_due, now + 2 * retry_after)

    def evaluate(self, clocks: Mapping[str, NodeClock], now: float, lc: Lifecycle) -> bool:
        """Stalls excused, then every node judged; True when a pass should look again.

        That is when a node moved, or the grace or the zone damping began or ended.
        """
        self.excuse_stall(clocks, now)
        prev = self.evaluation
        ev = evaluate(clocks, now, self.started_at, lc, prev.last_damped, self.grace_end(lc))
        if ev.hold_reason and ev.hold_reason != prev.hold_reason and ev.held:
            log.warning("not declaring %s lost: %s", ", ".join(ev.held), ev.hold_reason)
        self.evaluation = ev
        return bool(ev.transitions) or (ev.in_grace, ev.damped) != (prev.in_grace, prev.damped)

    def excuse_stall(self, clocks: Mapping[str, NodeClock], now: float) -> None:
        """Push every node's silence deadline back by the time this process's loop was stalled.

        Heartbeats that arrived while the loop was paused sit unread in the
        sockets; without this, the first pass after a pause would find every
        node silent for as long as the pause and declare the fleet unreachable.
        """
        # A loop always runs a little late; excusing each millisecond would walk
        # every node's clock on every pass.  Lateness adds up until it matters.
        self._stall_owed += self.looplag.take()
        if self._stall_owed < STALL_EXCUSED_FROM:
            return
        stall, self._stall_owed = self._stall_owed, 0.0
        excuse(clocks.values(), stall, now)
        self.stalled += stall
        if stall >= 1.0:
            log.warning("control plane stalled for %.1fs (its event loop did not run); "
                        "not counted against the nodes' heartbeats", stall)
