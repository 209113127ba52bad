"""Node lifecycle: ``ready`` -> ``unreachable`` -> ``lost``, decided from silence.

Pure: every function takes ``now`` (monotonic seconds) and returns what
changed, so the rules below are tested without clocks or sockets.

- A node is ``unreachable`` once it has been silent for ``unreachable_after``.
  Its replicas stay: its engines may well still serve, and the router talks
  to them directly.
- It is ``lost`` once silent for ``lost_after``; only then are its replicas
  placed elsewhere.
- A control plane that has just started declares nothing lost before
  ``startup_grace`` has passed, and silence is never counted from before it
  started: it cannot tell an agent still backing off from a dead one.  The
  grace lasts while agents are still arriving (``lifecycletimers``).
- When more than ``max_unreachable_share`` of the (not yet lost) fleet is
  unreachable at once, the fault is far more likely on the control plane's
  side of the network than on every node at once, so nobody is declared
  lost until the share falls again (Kubernetes' zone-disruption rule).
  When it falls, silence is counted afresh from the last damped pass, as
  after a restart: the first nodes to come back must not un-damp the fleet
  and get the others, still reconnecting, declared lost on the next pass.
- The control plane's own stalls (its event loop not running: a GC pause,
  VM steal, SIGSTOP) are not the nodes' silence: ``excuse`` extends every
  deadline by the stall measured (``looplag``).
- Replacements of lost nodes' replicas are rate-limited at all times
  (``ReplacementLimiter``), so a misjudgement moves a few replicas, not all.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from llmgw.protocol import NodeState  # the API reports it: defined with the wire vocabulary, read here too
from llmgw.settings import Lifecycle


@dataclass
class NodeClock:
    """What the lifecycle knows of one node: when it last spoke, and its state."""

    state: NodeState
    last_seen: float
    since: float  # when it entered ``state``
    last_frame: float = float("-inf")  # its last frame of any kind, pings included (the stream is alive)

    @classmethod
    def seen(cls, now: float) -> "NodeClock":
        return cls(NodeState.READY, now, now)


@dataclass(frozen=True)
class Transition:
    node_id: str
    old: NodeState
    new: NodeState
    reason: str


@dataclass(frozen=True)
class Evaluation:
    """The outcome of one lifecycle pass."""

    transitions: tuple[Transition, ...] = ()
    in_grace: bool = False  # the control plane started less than startup_grace ago
    damped: bool = False  # too many unreachable at once: nothing is declared lost
    last_damped: float | None = None  # the latest pass that was damped (this one or earlier)
    unreachable_share: float = 0.0
    held: tuple[str, ...] = field(default=())  # nodes past lost_after but not declared lost, and why in ``hold_reason``
    hold_reason: str | None = None


def observe(node_id: str, clock: NodeClock | None, now: float) -> tuple[NodeClock, Transition | None]:
    """A node spoke (registered, heartbeat, any valid message): it is ready again."""
    if clock is None:
        return NodeClock.seen(now), None
    old = clock.state
    clock.last_seen = max(clock.last_seen, now)
    if old is NodeState.READY:
        return clock, None
    clock.state, clock.since = NodeState.READY, now
    return clock, Transition(node_id, old, NodeState.READY, "heard from again")


def excuse(clocks: Iterable[NodeClock], stall: float, now: float) -> None:
    """The control plane was stalled for ``stall`` seconds: not the nodes' silence.

    Every node's last word moves forward by the stall (never past ``now``),
    so each deadline is extended by exactly the time the control plane could
    not read (Nomad's ``failover_heartbeat_ttl``, measured instead of fixed).
    """
    for c in clocks:
        c.last_seen = min(now, c.last_seen + stall)
        c.last_frame = min(now, c.last_frame + stall)


def half_open(clock: NodeClock, now: float, timings: Lifecycle) -> bool:
    """A stream that has carried nothing, not even a ping, for two ping intervals.

    A live agent pings every ``keepalive_interval`` even when its heartbeats
    stop, so a connection that silent has lost its other end without a word
    (a frozen process, a host powered off, a cut cable).  The control
    plane's own stalls are excused from ``last_frame`` as from ``last_seen``.
    """
    return now - max(clock.last_seen, clock.last_frame) > 2 * timings.keepalive_interval


def silence(clock: NodeClock, now: float, started_at: float) -> float:
    """Seconds without a word, never counted from before the control plane started."""
    return max(0.0, now - max(clock.last_seen, started_at))


def evaluate(
    clocks: Mapping[str, NodeClock],
    now: float,
    started_at: float,
    timings: Lifecycle,
    last_damped: float | None = None,
    grace_until: float | None = None,
) -> Evaluation:
    """Advance every node's state by its silence; mutates ``clocks`` in place.

    ``last_damped``: the previous evaluation's ``last_damped``; the silence
    that makes a node lost is not counted from before it.  ``grace_until``:
    when the startup grace ends, if not ``startup_grace`` after ``started_at``
    (it is held while agents are still arriving).
    """
    # Called every tick over the whole fleet: one pass over the clocks, sorting
    # only the nodes that change (a settled fleet of 10,000 has none), not the fleet.
    transitions: list[Transition] = []
    in_grace = now < grace_until if grace_until is not None else now - started_at < timings.startup_grace
    ready, unreachable_state, lost_state = NodeState.READY, NodeState.UNREACHABLE, NodeState.LOST
    after = timings.unreachable_after
    going: list[str] = []
    down: list[str] = []  # unreachable, before this pass or by it
    alive = 0
    for node_id, c in clocks.items():
        state = c.state
        if state is lost_state:
            continue
        alive += 1
        if state is ready:
            last = c.last_seen
            if now - (last if last > started_at else started_at) > after:
                going.append(node_id)
                down.append(node_id)
        elif state is unreachable_state:
            down.append(node_id)
    for node_id in sorted(going):
        c = clocks[node_id]
        quiet = silence(c, now, started_at)
        transitions.append(Transition(node_id, c.state, NodeState.UNREACHABLE,
                                      f"silent for {quiet:.1f}s (unreachable_after {timings.unreachable_after:g}s)"))
        c.state, c.since = NodeState.UNREACHABLE, now

    unreachable = len(down)
    share = unreachable / alive if alive else 0.0
    damped = share > timings.max_unreachable_share
    # while damped, silence counts as usual (``held`` shows who would be lost); once the
    # damping ends, only the silence since the last damped pass counts
    counted_from = started_at if damped or last_damped is None else max(started_at, last_damped)
    if damped:
        last_damped = now

    due = sorted(n for n in down if silence(clocks[n], now, counted_from) > timings.lost_after)
    hold_reason: str | None = None
    if due and in_grace:
        held_longer = now - started_at >= timings.startup_grace
        hold_reason = (f"control plane started {now - started_at:.1f}s ago "
                       f"(startup_grace {timings.startup_grace:g}s"
                       f"{', held while agents are still arriving' if held_longer else ''}): "
                       "no node is declared lost yet")
    elif due and damped:
        hold_reason = (f"{unreachable} of {alive} nodes unreachable at once "
                       f"({share:.0%} > max_unreachable_share {timings.max_unreachable_share:.0%}): "
                       "treated as a control-plane-side network fault, no node is declared lost")
    if hold_reason is None:
        for node_id in due:
            c = clocks[node_id]
            quiet = silence(c, now, counted_from)
            transitions.append(Transition(node_id, c.state, NodeState.LOST,
                                          f"silent for {quiet:.1f}s (lost_after {timings.lost_after:g}s)"))
            c.state, c.since = NodeState.LOST, now
    return Evaluation(
        transitions=tuple(transitions),
        in_grace=in_grace,
        damped=damped,
        last_damped=last_damped,
        unreachable_share=share,
        held=tuple(due) if hold_reason else (),
        hold_reason=hold_reason,
    )


@dataclass
class ReplacementLimiter:
    """At most ``per_minute`` replacements in any 60 seconds (a sliding window).

    A token bucket refilled at ``per_minute`` a minute lets a full bucket go
    at once and as much again within the same minute: twice the bound the
    operator set.  The window remembers when each recent replacement was
    made instead.
    """

    per_minute: int
    made: deque = field(default_factory=deque)  # when the replacements of the last 60 s were made

    def _forget(self, now: float) -> None:
        while self.made and now - self.made[0] >= 60.0:
            self.made.popleft()

    def available(self, now: float) -> bool:
        self._forget(now)
        return len(self.made) < self.per_minute

    def take(self, now: float) -> bool:
        """Spend one replacement if allowed now."""
        if not self.available(now):
            return False
        self.made.append(now)
        return True

    def retune(self, per_minute: int, now: float) -> None:
        """Apply a reloaded rate without forgetting what was spent."""
        self._forget(now)
        self.per_minute = per_minute
