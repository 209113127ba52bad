"""The clocks the node lifecycle runs on: the startup grace, the fleet's size, this process's own stalls.

Nodes are judged on silence, so the control plane must not count its own
pauses against them: the lag of its event loop (``looplag``) is added up
and, once it matters, every node's deadlines are pushed back by it before
the lifecycle is evaluated.

The startup grace is held while agents are still arriving (``note_arrival``,
``grace_end``): a restart whose fleet dials back slower than the grace (a
starved host, the per-source connection cap, handshakes timing out) must not
judge the agents still in line, nor place their replicas again elsewhere.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

from llmgw.controlplane.lifecycle import Evaluation, NodeClock, evaluate, excuse
from llmgw.controlplane.looplag import LoopLag
from llmgw.settings import Lifecycle

log = logging.getLogger("llmgw.controlplane")

STALL_EXCUSED_FROM = 0.25  # seconds of loop lateness, added up, before the nodes' deadlines are pushed back
# The startup grace is held while agents are still arriving, up to this many times
# startup_grace: a restart that cannot take its fleet back within the grace must not judge
# the agents still waiting in line (and re-place their replicas), nor wait forever.
MAX_GRACE_FACTOR = 4.0

# What counts as an agent arriving (``LifecycleTimers.note_arrival``), in the order logged.
ARRIVALS = {
    "registered": "registered",
    "admitted": "streams admitted",
    "refused": "refused by admission",
    "shed": "dials dropped before their TLS handshake",
    "waiting": "dials waiting for a TLS handshake",
    "capped": "dials aborted at max_connections_per_source",
    "timed_out": "TLS handshakes timed out",
}


class LifecycleTimers:
    def __init__(self, started_at: float, after_a_run: bool = True):
        self.started_at = started_at  # the startup (or failover) grace counts from here
        # Whether an earlier control plane ran on this store (it handed out an epoch): only then can
        # agents still arriving bring engines it placed. A store that never ran one placed nothing
        # anywhere, so its first grace is startup_grace alone: agents arriving hold nothing, and a
        # first rollout, whose agents start while the grace runs, does not wait startup_grace more.
        self.after_a_run = after_a_run
        self.evaluation = Evaluation()
        self.looplag = LoopLag()  # this process's own stalls, not counted against agents
        self.stalled = 0.0  # seconds of stall excused so far, for logs and tests
        self._stall_owed = 0.0  # loop lateness not yet excused (see excuse_stall)
        self._fleet_size = 0  # the most nodes known at once: sizes the heartbeat interval
        self._refused_due = 0.0  # when the last agents refused during the grace are due back
        self._last_arrival = float("-inf")  # the latest sign during the grace of an agent arriving
        self.arrivals = dict.fromkeys(ARRIVALS, 0)  # those signs during this grace, by kind
        self._held_logged = False  # "held past startup_grace" said for this grace
        self._grace_open = True  # the end of this grace not yet logged

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
        # The interval grows with every node past the cap; said once on leaving the configured one,
        # then once a second of growth (a 10,000-node start once wrote this line 7,500 times).
        grew_from_configured = before.heartbeat_interval == configured.heartbeat_interval < after.heartbeat_interval
        if grew_from_configured or math.floor(after.heartbeat_interval) != math.floor(before.heartbeat_interval):
            log.info("%d nodes: heartbeat every %.1fs (max_heartbeats_per_second %g); unreachable after %.1fs, "
                     "lost after %.1fs", nodes, after.heartbeat_interval,
                     after.max_heartbeats_per_second, after.unreachable_after, after.lost_after)

    def restart(self, now: float, after_a_run: bool = True) -> None:
        """A new grace from ``now`` (taking the lead): nothing judged before agents have moved over."""
        self.started_at = now
        self.after_a_run = after_a_run
        self._refused_due = 0.0
        self._last_arrival = float("-inf")
        self.arrivals = dict.fromkeys(ARRIVALS, 0)
        self._held_logged = False
        self._grace_open = True
        self.evaluation = Evaluation()

    def grace_end(self, lc: Lifecycle) -> float:
        """When the startup grace ends: ``startup_grace`` after the start, or later while agents are arriving.

        It ends at the earliest of ``MAX_GRACE_FACTOR x startup_grace`` after
        the start and the latest of: ``startup_grace`` after the start;
        ``startup_grace`` after the last agent seen arriving; twice the
        Retry-After of the last admission refusal after it.

        ``startup_grace`` is sized to cover an agent's reconnect backoff
        (``reconnect_max``), so an agent whose dial failed (aborted at the
        per-source cap, its handshake timed out) is back within it; while any
        agent keeps arriving, a silent node may be one still in line, not a
        dead one.  An agent refused by admission is told a Retry-After and
        comes back within twice that.
        """
        base = self.started_at + lc.startup_grace
        arrived = self._last_arrival + lc.startup_grace if self.after_a_run else base
        held = max(self._refused_due, arrived)
        if held <= base:
            return base
        return min(held, self.started_at + MAX_GRACE_FACTOR * lc.startup_grace)

    def grace_left(self, now: float, lc: Lifecycle) -> float:
        return max(0.0, self.grace_end(lc) - now)

    def note_refused(self, now: float, retry_after: float, lc: Lifecycle) -> None:
        """An agent refused admission during the grace holds it until it is due back (``grace_end``).

        Refusals after the grace has ended change nothing: a settled fleet's
        nodes are judged by their silence as always.
        """
        if now < self.grace_end(lc):
            self._refused_due = max(self._refused_due, now + 2 * retry_after)
            self.note_arrival(now, "refused", lc)

    def note_arrival(self, now: float, kind: str, lc: Lifecycle) -> None:
        """A sign of an agent arriving (a key of ``ARRIVALS``): during the grace, it holds the grace (``grace_end``).

        Signs after the grace has ended change nothing: a settled fleet's
        nodes are judged by their silence as always, and a node that flaps
        must not hold judgement off the others.
        """
        if now < self.grace_end(lc):
            self._last_arrival = max(self._last_arrival, now)
            self.arrivals[kind] += 1

    def _arrivals_said(self) -> str:
        return ", ".join(f"{self.arrivals[k]} {what}" for k, what in ARRIVALS.items() if self.arrivals[k]) \
            or "no agent seen"

    def _log_grace(self, in_grace: bool, now: float, nodes: int, lc: Lifecycle) -> None:
        """Once per grace: when agents still arriving hold it past ``startup_grace``, and when it ends, and why."""
        if not self._grace_open or lc.startup_grace <= 0:
            return
        since = now - self.started_at
        last = now - self._last_arrival
        late = self._last_arrival >= self.started_at + lc.startup_grace  # an agent arrived after startup_grace
        if in_grace and late and not self._held_logged:
            self._held_logged = True
            log.warning("startup grace held past startup_grace %gs: agents still arriving (last %.1fs ago; %d nodes "
                        "registered; %s); it ends once none has arrived for %gs, at the latest %gs after the start",
                        lc.startup_grace, last, nodes, self._arrivals_said(), lc.startup_grace,
                        MAX_GRACE_FACTOR * lc.startup_grace)
        elif not in_grace:
            self._grace_open = False
            capped = since >= MAX_GRACE_FACTOR * lc.startup_grace and last < lc.startup_grace
            why = (f"held to its limit, {MAX_GRACE_FACTOR:g} x startup_grace, with agents still arriving "
                   f"({last:.1f}s ago)" if capped else f"no agent arriving for startup_grace {lc.startup_grace:g}s"
                   if self.after_a_run else "the first control plane on this store: startup_grace alone")
            log.log(logging.WARNING if capped else logging.INFO,
                    "startup grace over after %.1fs (%s): %d nodes registered; %s; silent nodes are judged and "
                    "missing replicas placed from now", since, why, nodes, self._arrivals_said())

    def evaluate(self, clocks: Mapping[str, NodeClock], now: float, lc: Lifecycle) -> bool:
        """Stalls excused, then every node judged; True when a pass should look again.

        That is when a node moved, or the grace or the zone damping began or ended.
        """
        self.excuse_stall(clocks, now)
        prev = self.evaluation
        ev = evaluate(clocks, now, self.started_at, lc, prev.last_damped, self.grace_end(lc))
        self._log_grace(ev.in_grace, now, len(clocks), lc)
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
