"""How many replicas an autoscaled deployment should have: a KPA-like rule, pure.

Knative's pod autoscaler, adapted to GPUs, where a replica takes minutes to
start and a wrong scale-down costs a reload: the signal (the routers'
requests in flight to the deployment) is averaged over a long *stable*
window and a short *panic* window.  The stable average alone can scale down;
a burst that makes the panic average ask for ``panic_threshold`` times the
current count starts a panic, which scales up on the short window and never
down until a stable window has passed without one.  Damping, in order:

- where set, a scale-down goes no lower than the most any decision wanted
  over the last ``scale_down_stabilization`` seconds (Kubernetes' scale-down
  stabilization window): a dip between two busy spells keeps the replicas
  the next spell needs;
- a dead band (``tolerance``): no change while the wanted count is within
  that fraction of the current one;
- no scale-down before a whole stable window has been measured: a scaler
  that has just begun (a control plane started or taken over, a policy
  changed) has an average of seconds, often of one instant between
  requests, and would otherwise drain replicas that serve a busy model;
- a scale-down only ``scale_down_cooldown`` after the last change;
- at most one reversal of direction per cooldown, so a signal that swings
  around the target cannot make the fleet load and unload a model in turn
  (except from zero replicas, where any demand has nothing else to serve it:
  there the latest sample, not a window, asks for the first replica);
- at most ``max_step`` replicas per decision;
- where set, a scale-up to at most ``max_scale_up_rate`` times the replicas
  already Ready (Knative's max-scale-up-rate): the requests in flight keep
  growing while the replicas asked for are still loading, and a rule that
  took that queue for demand would ask again every pass, up to ``max``;
- the result clamped to ``min``..``max``.

The count wanted covers the average in flight at ``target`` per replica,
plus ``headroom`` standard deviations of it (``headroom x sqrt(average)``:
requests arriving at random have a Poisson count in flight).  This is the
square-root staffing rule of queueing theory: the spare slots a pool needs
to keep waiting rare grow with the square root of its load, not in
proportion, so a fixed per-replica target is too tight for one replica and
too loose for twenty.  With ``target`` set to the engine's batch, a
``headroom`` of 2.5 and a 120 s ``scale_down_stabilization`` (3 to 4 without
it), the count follows the demand at close to the efficiency of a static
pool sized with hindsight (``benchmarks/results/autoscale.md``).

A replica serves only minutes after it is placed (fetch, load), so a rule
that waits to see the demand is late on every ramp by that long.  Given the
deployment's *lead time* (how long its last replicas took from placement to
Ready, ``autoscale_lead``), a rising signal is followed ahead: when the
average of each quarter of the stable window is above the one before, the
smallest of those rises is the trend, which extends the average to ``lead``
seconds from now, and a count that asks for more than the average itself
scales up early (reason ``ahead``).  Every quarter must rise, so a step (a
burst, a batch job starting: flat before and after) is never extrapolated
into a ramp (the panic window answers steps), and rise by more than its
scatter, so noise is not either.  Only up: a falling trend never
scales down early (the cooldown and the reversal rule stand as they are).

No clock and no I/O here: ``observe`` and ``decide`` take ``now``, so every
rule is unit-tested on a fake clock (``tests/unit/test_autoscale.py``).  The
control plane feeds it (``controlplane/autoscaler.py``) and the reconciler
places the count it decides (``reconcile/replicacount.py``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from llmgw.catalog import Autoscale

# Why the count is what it is: the ``reason`` label of llmgw_autoscale_desired_replicas.
START = "start"  # the declared replicas, clamped: nothing measured yet
NO_SIGNAL = "no-signal"  # nothing measured in the stable window: the count stays
STABLE = "stable"  # the stable window's average asks for this count
PANIC = "panic"  # a burst: the panic window's average (never down)
AHEAD = "ahead"  # a rising signal, extended by the lead time: up before the demand arrives
TOLERANCE = "tolerance"  # the wanted count is within the dead band: kept
MEASURING = "measuring"  # a scale-down waits until a whole stable window has been measured
COOLDOWN = "cooldown"  # a scale-down waits for the cooldown after the last change
REVERSAL = "reversal"  # a second change of direction within one cooldown: refused
STEP = "step"  # the change was capped at max_step
MIN = "min"  # clamped up to min
MAX = "max"  # clamped down to max
HOLD = "hold"  # a scale-down held to the most wanted over the last scale_down_stabilization
RATE = "rate"  # a scale-up held to max_scale_up_rate x the Ready replicas: the last ones asked for do not serve yet
FROM_ZERO = "from-zero"  # demand at zero replicas (min 0): one at once, before any window has seen it
QUARTERS = 4  # the stable window's parts that must each rise on the one before for a trend to count
NOISE = 3.0  # standard errors of the two quarters' scatter a rise must exceed
# what the signal's total is, in ``ctl explain`` (a deployment's total: the target is per replica)
SEEN = {"outstanding": "in flight", "queue_depth": "waiting in the engines",
        "kv_cache_use": "KV-cache use summed over the replicas"}
REASONS = (START, NO_SIGNAL, STABLE, PANIC, AHEAD, HOLD, TOLERANCE, MEASURING, COOLDOWN, REVERSAL, STEP, RATE,
           MIN, MAX, FROM_ZERO)


@dataclass(frozen=True)
class Decision:
    desired: int
    reason: str
    wanted: int | None = None  # what the signal asked for, before damping and clamping
    stable: float | None = None  # the stable window's average signal (the deployment's total)
    panic: float | None = None  # the panic window's average signal
    panicking: bool = False
    lead: float | None = None  # seconds a new replica takes to serve, as measured (None: not measured yet)
    ahead: float | None = None  # the signal expected ``lead`` seconds from now, where the trend rises

    def explain(self, policy: Autoscale) -> str:
        seen = ("nothing measured yet" if self.stable is None else
                f"{self.stable:.2f} {SEEN.get(policy.signal, policy.signal)} over {policy.stable_window:g}s, "
                f"{self.panic:.2f} over {policy.panic_window:g}s, target {policy.target:g} per replica"
                + (f" plus {policy.headroom:g} x sqrt(in flight) spare" if policy.headroom else "")
                + (f", {self.ahead:.2f} expected in {self.lead:.0f}s (a new replica's start)"
                   if self.ahead is not None and self.lead is not None else "")
                + (f", asking for {self.wanted}" if self.wanted is not None else ""))
        return (f"autoscale {policy.min}..{policy.max}: {self.desired} replica(s) ({self.reason}"
                f"{', panicking' if self.panicking else ''}); saw {seen}"
                + ("; at zero: the routers hold a request while a replica starts" if not self.desired else ""))


def wanted(policy: Autoscale, average: float) -> int:
    """Replicas whose ``target`` each covers ``average`` plus ``headroom`` x its square root."""
    slots = average + policy.headroom * math.sqrt(max(0.0, average)) if policy.headroom else average
    # a hair below an integer is that integer: 16.000000001/8 must not ask for 3
    return max(0, math.ceil(slots / policy.target - 1e-9))


class Scaler:
    """One deployment's samples and damping state; ``decide`` moves ``desired``."""

    def __init__(self, policy: Autoscale, start: int, now: float):
        self.policy = policy
        self.desired = policy.clamp(start)
        self.samples: deque[tuple[float, float]] = deque()
        self.measured_from: float | None = None  # the first sample: no scale-down for a stable window after it
        self.last_change_at: float | None = None
        self.last_direction = 0
        self.last_reversal_at: float | None = None
        self.panic_until: float | None = None
        self.wants: deque[tuple[float, int]] = deque()  # (when, wanted), wants falling: the window's max first
        reason = START if self.desired == start else (MIN if self.desired > start else MAX)
        self.decision = Decision(self.desired, reason)

    def observe(self, now: float, total: float) -> None:
        """The deployment's signal now (requests in flight to all its replicas); it holds until the next."""
        self.samples.append((now, max(0.0, float(total))))
        if self.measured_from is None:
            self.measured_from = now
        horizon = now - self.policy.stable_window
        while len(self.samples) > 1 and self.samples[1][0] <= horizon:
            self.samples.popleft()  # the one before the horizon stays: it holds the value at the horizon

    def _average(self, now: float, window: float) -> float | None:
        """Time-weighted over the last ``window`` seconds, so that passes run in a burst (kicks)
        weigh no more than one long quiet second; None before the first sample."""
        return self._mean(now - window, now, now)

    def _mean(self, start: float, stop: float, now: float) -> float | None:
        """The time-weighted signal between ``start`` and ``stop`` (each sample holds until the next, the
        last until ``now``); the last sample's value where nothing covers the span."""
        if not self.samples:
            return None
        area, covered = 0.0, 0.0
        samples = list(self.samples)
        for i, (t, v) in enumerate(samples):
            end = samples[i + 1][0] if i + 1 < len(samples) else now
            a, b = max(t, start), min(end, stop)
            if b > a:
                area, covered = area + v * (b - a), covered + (b - a)
        return area / covered if covered > 0 else samples[-1][1]

    def _quarters(self, now: float) -> list[tuple[float, float]] | None:
        """Per quarter of the stable window: (time-weighted mean, its standard error), in one pass
        over the samples; None where a quarter is not covered. The error treats each sample in a
        quarter as one observation (they are correlated, which ``NOISE`` allows for)."""
        w = self.policy.stable_window
        q, start = w / QUARTERS, now - w
        area, sq, covered, n = [0.0] * QUARTERS, [0.0] * QUARTERS, [0.0] * QUARTERS, [0] * QUARTERS
        samples = self.samples
        nxt = iter(samples)
        next(nxt, None)
        for (t, v), following in zip(samples, [*(s[0] for s in nxt), now]):
            a, b = max(t, start), min(following, now)
            while b > a:
                j = min(QUARTERS - 1, int((a - start) // q))
                cut = min(b, start + (j + 1) * q)
                d = cut - a
                area[j], sq[j], covered[j], n[j] = area[j] + v * d, sq[j] + v * v * d, covered[j] + d, n[j] + 1
                a = cut
        out = []
        for j in range(QUARTERS):
            if covered[j] <= 0:
                return None
            mean = area[j] / covered[j]
            out.append((mean, math.sqrt(max(0.0, sq[j] / covered[j] - mean * mean) / n[j])))
        return out

    def _ahead(self, now: float, stable: float, panic: float, lead: float) -> float | None:
        """The signal expected ``lead`` seconds from now where it rose through every quarter of the
        stable window, else None.

        The trend is the smallest rise between consecutive quarters' averages, so a step shows as
        none (some quarter is flat), and each rise must stand ``NOISE`` standard errors above the
        two quarters' own scatter, so a noisy flat signal whose quarters happen to climb is not
        taken for a ramp (the projection multiplies whatever it is given). A linear ramp's average
        over the window is its value half a window ago, so the expectation is that average moved
        on by the trend for half a window plus the lead."""
        w = self.policy.stable_window
        if lead <= 0 or self.measured_from is None or now - self.measured_from < w:
            return None  # no trend from less than a whole window
        if panic <= stable:
            return None  # the latest seconds are not above the window's average: not rising now
        parts = self._quarters(now)
        if parts is None:
            return None
        rises = []
        for (a, ea), (b, eb) in zip(parts, parts[1:]):
            if b - a <= NOISE * math.hypot(ea, eb):
                return None
            rises.append(b - a)
        return stable + min(rises) / (w / QUARTERS) * (w / 2 + lead)

    def _want(self, average: float) -> int:
        return wanted(self.policy, average)

    def _hold(self, now: float, want: int) -> int:
        """The most any decision wanted over the last ``scale_down_stabilization`` seconds, ``want``
        included: a scale-down goes no lower (Kubernetes' scale-down stabilization window). A dip
        between two busy spells would otherwise drain a replica the next spell needs, and the
        scale-up that follows within the cooldown is a reversal the rule refuses: the queue grows
        meanwhile. A deque whose wants fall from left to right: the window's maximum is its first."""
        window = self.policy.scale_down_stabilization
        if not window:
            return want
        wants = self.wants
        while wants and wants[-1][1] <= want:
            wants.pop()
        wants.append((now, want))
        horizon = now - window
        while wants[0][0] < horizon:
            wants.popleft()
        return wants[0][1]

    def decide(self, now: float, lead: float | None = None, ready: int | None = None) -> Decision:
        """The count for now; ``lead``: seconds a new replica of the deployment takes to serve (None or 0:
        not known, nothing is anticipated); ``ready``: its replicas serving now (None: not known, a
        scale-up is not held to ``max_scale_up_rate`` of them)."""
        p, current = self.policy, self.desired
        stable, panic = self._average(now, p.stable_window), self._average(now, p.panic_window)
        if stable is None or panic is None:
            self.decision = Decision(current, NO_SIGNAL, lead=lead)
            return self.decision
        want_stable, want_panic = self._want(stable), self._want(panic)
        if want_panic > current and want_panic >= p.panic_threshold * max(current, 1):
            self.panic_until = now + p.stable_window  # a stable window without a new burst ends it
        panicking = self.panic_until is not None and now < self.panic_until
        if panicking:
            want, reason = max(want_panic, want_stable, current), PANIC
        else:
            self.panic_until = None
            want, reason = want_stable, STABLE
        ahead = self._ahead(now, stable, panic, lead or 0.0)
        if ahead is not None and not panicking and self._want(ahead) > want:
            want, reason = self._want(ahead), AHEAD
        if not current and not want and self.samples[-1][1] > 0:
            # a request waits for a deployment with no replica: a sample just taken weighs nothing in
            # either window yet, and a pass later is a second more of a cold start the client waits out
            want, reason = 1, FROM_ZERO
        held = self._hold(now, want)  # recorded on every decision, used only on the way down
        new = want if want >= current else min(current, held)
        if new > want:
            reason = HOLD
        direction = (new > current) - (new < current)
        if direction and current and abs(new - current) <= p.tolerance * current:
            new, reason = current, TOLERANCE
        elif direction < 0 and self.measured_from is not None and now - self.measured_from < p.stable_window:
            new, reason = current, MEASURING
        elif direction < 0 and self.last_change_at is not None and now - self.last_change_at < p.scale_down_cooldown:
            new, reason = current, COOLDOWN
        elif (direction and current and self.last_direction and direction != self.last_direction
              and self.last_reversal_at is not None and now - self.last_reversal_at < p.scale_down_cooldown):
            # (never from zero: demand for a deployment with no replica has nothing else to serve it)
            new, reason = current, REVERSAL
        elif abs(new - current) > p.max_step:
            new, reason = current + direction * p.max_step, STEP
        if new > current and ready is not None and p.max_scale_up_rate:
            cap = math.ceil(p.max_scale_up_rate * max(ready, 1) - 1e-9)
            if new > cap:
                new, reason = max(current, cap), RATE
        if p.clamp(new) != new:
            new, reason = p.clamp(new), (MIN if new < p.min else MAX)
        moved = (new > current) - (new < current)
        if moved:
            if self.last_direction and moved != self.last_direction:
                self.last_reversal_at = now
            self.last_direction, self.last_change_at = moved, now
            self.desired = new
        self.decision = Decision(new, reason, want, stable, panic, panicking, lead, ahead)
        return self.decision
