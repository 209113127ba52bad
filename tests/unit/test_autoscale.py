"""The autoscale rule on a fake clock: windows, panic, tolerance, cooldown, reversals, step, bounds."""

from __future__ import annotations

import dataclasses
import random

from llmgw.catalog import Autoscale
from llmgw.controlplane import autoscale as a
from llmgw.controlplane.autoscale import Scaler


def policy(**kw) -> Autoscale:
    base = dict(max=10, min=1, target=4, stable_window=60, panic_window=6, panic_threshold=2,
                tolerance=0.1, scale_down_cooldown=300, max_step=4)
    base.update(kw)
    return Autoscale(**base)


def feed(s: Scaler, start: float, end: float, value: float, every: float = 1.0):
    t, d = start, None
    while t <= end:
        s.observe(t, value)
        d = s.decide(t)
        t += every
    return d


def test_start_is_declared_clamped_and_nothing_moves_without_a_signal():
    assert Scaler(policy(), 3, 0).desired == 3
    s = Scaler(policy(min=2), 1, 0)
    assert (s.desired, s.decision.reason) == (2, a.MIN)
    assert Scaler(policy(max=5), 9, 0).decision.reason == a.MAX
    d = s.decide(10)
    assert (d.desired, d.reason) == (2, a.NO_SIGNAL)


def test_steady_load_scales_up_on_the_stable_window_to_ceil_load_over_target():
    s = Scaler(policy(), 1, 0)
    d = feed(s, 0, 120, 6)  # 6 in flight / 4 per replica -> 2; 2x of 1 is also a panic
    assert d.desired == 2


def test_burst_panics_within_the_panic_window_and_is_capped_by_max_step():
    s = Scaler(policy(), 1, 0)
    feed(s, 0, 60, 0)
    d = feed(s, 61, 64, 40)  # 40/4 = 10 wanted: the stable average lags, the panic one does not
    assert d.panicking and d.reason in (a.PANIC, a.STEP)
    assert s.desired >= 5
    first = [s.desired]
    assert first[0] <= 1 + 4 + 4 + 4  # at most max_step per decision


def test_panic_never_scales_down():
    s = Scaler(policy(scale_down_cooldown=0), 1, 0)
    feed(s, 0, 10, 40)
    top = s.desired
    d = feed(s, 11, 20, 0)  # still within a stable window of the burst
    assert d.panicking and s.desired == top


def test_scale_down_waits_for_the_cooldown_then_goes_to_min():
    s = Scaler(policy(scale_down_cooldown=100, stable_window=10, panic_window=2), 1, 0)
    feed(s, 0, 20, 16)
    assert s.desired == 4
    changed = s.last_change_at
    d = feed(s, 21, changed + 99, 0)
    assert (s.desired, d.reason) == (4, a.COOLDOWN)
    feed(s, changed + 100, changed + 140, 0)
    assert s.desired == 1


def test_no_scale_down_before_a_whole_stable_window_is_measured():
    """A scaler that has just begun (a control plane started or taken over) has seconds of signal,
    often one instant between requests: it must not drain a busy model on that."""
    s = Scaler(policy(stable_window=60, scale_down_cooldown=0), 4, 1000)
    s.observe(1000, 0)  # the first sample happens to fall between requests
    d = s.decide(1000)
    assert (d.desired, d.reason) == (4, a.MEASURING)
    d = feed(s, 1001, 1059, 14)  # busy: 14 in flight wants 4
    assert s.desired == 4
    d = feed(s, 1060, 1200, 0)  # a whole window measured, then idle: down it goes
    assert s.desired == 1
    up = Scaler(policy(stable_window=60), 1, 0)  # scaling up is never held back by it
    up.observe(0, 40)
    assert up.decide(0).desired > 1


def test_tolerance_keeps_the_count_in_the_dead_band():
    s = Scaler(policy(tolerance=0.25, panic_threshold=100), 8, 0)
    d = feed(s, 0, 120, 36)  # wants 9 of 8: within 25 %
    assert (d.desired, d.reason) == (8, a.TOLERANCE)


def test_bounds():
    s = Scaler(policy(max=3), 1, 0)
    d = feed(s, 0, 120, 400)
    assert (d.desired, d.reason) == (3, a.MAX)


def test_at_most_one_reversal_per_cooldown():
    s = Scaler(policy(scale_down_cooldown=30, stable_window=5, panic_window=1, max_step=10), 1, 0)
    feed(s, 0, 10, 20)  # up
    assert s.desired == 5
    t = 11
    while s.desired != 1:  # down after the cooldown: the first reversal
        s.observe(t, 0)
        s.decide(t)
        t += 1
    assert s.last_reversal_at == t - 1 >= 30
    d = feed(s, t, t + 10, 20)  # up again within a cooldown of that reversal: refused
    assert (s.desired, d.reason) == (1, a.REVERSAL)
    feed(s, t + 11, s.last_reversal_at + 31, 20)  # a cooldown later it may
    assert s.desired == 5


def test_a_noisy_signal_around_the_target_does_not_flap():
    """Load swinging +-50 % around 3 replicas' worth, every second, for an hour: the count
    settles, and direction changes at most once per cooldown."""
    rng = random.Random(7)
    p = policy(scale_down_cooldown=300, max=20)
    s = Scaler(p, 3, 0)
    history = []
    for t in range(3600):
        s.observe(t, 12 * rng.uniform(0.5, 1.5))
        history.append((t, s.decide(t).desired))
    changes = [(t, n) for (t, n), (_, m) in zip(history[1:], history) if n != m]
    directions = []
    for (t, n), (_, m) in zip(history[1:], history):
        if n != m:
            directions.append((t, 1 if n > m else -1))
    reversals = [t for (t, d), (_, e) in zip(directions[1:], directions) if d != e]
    for r1, r2 in zip(reversals, reversals[1:]):
        assert r2 - r1 >= p.scale_down_cooldown
    assert len(changes) <= 3600 // p.scale_down_cooldown + 2
    assert 2 <= s.desired <= 5


def ramp(s: Scaler, start: float, end: float, slope: float, lead: float | None, base: float = 0.0):
    """A signal rising ``slope`` a second from ``base``; the last decision, told ``lead``."""
    t, d = start, None
    while t <= end:
        s.observe(t, base + slope * (t - start))
        d = s.decide(t, lead)
        t += 1.0
    return d


def test_a_rising_signal_is_followed_ahead_by_the_lead_time():
    # 0.1 more in flight each second, target 4: at t=90 the stable average is 6 (2 replicas),
    # the signal itself 9 (3), and 90 s on, when a replica placed now would serve, 18 (5)
    p = policy(max=20, max_step=10, panic_threshold=100)  # no panic: the stable window alone
    late, early = Scaler(p, 1, 0), Scaler(p, 1, 0)
    d_late, d_early = ramp(late, 0, 90, 0.1, None), ramp(early, 0, 90, 0.1, 90.0)
    assert (d_late.desired, d_late.reason, d_late.ahead) == (2, a.STABLE, None)
    assert (d_early.desired, d_early.reason) == (5, a.AHEAD)
    assert abs(d_early.ahead - 18.0) < 0.2 and d_early.lead == 90.0
    assert "expected in 90s (a new replica's start)" in d_early.explain(p)


def test_no_anticipation_without_a_lead_a_whole_window_or_a_rise():
    p = policy(max=20, max_step=10, panic_threshold=100)
    s = Scaler(p, 1, 0)
    assert ramp(s, 0, 50, 0.1, 90.0).ahead is None  # less than a stable window measured
    s = Scaler(p, 1, 0)
    assert ramp(s, 0, 90, 0.1, 0.0).reason == a.STABLE  # no start measured yet
    flat = Scaler(p, 1, 0)
    assert ramp(flat, 0, 120, 0.0, 90.0, base=8.0).ahead is None


def test_a_falling_signal_never_scales_down_early():
    p = policy(max=20, max_step=10, panic_threshold=100, scale_down_cooldown=30)
    told, blind = Scaler(p, 1, 0), Scaler(p, 1, 0)
    for s, lead in ((told, 90.0), (blind, None)):
        ramp(s, 0, 120, 0.0, lead, base=20.0)  # 5 replicas
        ramp(s, 121, 200, -0.2, lead, base=20.0)
    assert told.desired == blind.desired and told.decision.reason == blind.decision.reason


def test_a_step_is_never_extrapolated_into_a_ramp():
    # a burst or a batch job starting: flat before and after; wherever the step falls in the window,
    # some quarter does not rise, so the rule is told the lead time and does exactly as without it
    p = policy(max=20, max_step=10, panic_threshold=100)
    for at in (61, 70, 80, 95, 110, 118):
        told, blind = Scaler(p, 1, 0), Scaler(p, 1, 0)
        for s, lead in ((told, 90.0), (blind, None)):
            ramp(s, 0, at - 1, 0.0, lead, base=4.0)
            ramp(s, at, 120, 0.0, lead, base=12.0)
        assert told.decision.ahead is None, at
        assert (told.desired, told.decision.reason) == (blind.desired, blind.decision.reason), at


def test_noise_whose_quarters_happen_to_climb_is_not_a_ramp():
    # Poisson-like scatter around a flat 20 in flight: without the gate on each rise, one window in
    # 24 has four climbing quarters and would be projected 90 s ahead (on the benchmark's diurnal
    # trace that cost 11 points of GPU-hours saved, with no window's TTFT better for it)
    p = policy(max=20, max_step=10, panic_threshold=100, target=4)
    rng = random.Random(7)
    s = Scaler(p, 5, 0)
    aheads = 0
    for t in range(0, 3600):
        s.observe(float(t), max(0.0, rng.gauss(20.0, 4.5)))
        aheads += s.decide(float(t), 90.0).reason == a.AHEAD
    assert aheads == 0
    # the same scatter on a steep ramp (+0.5 in flight a second) is followed ahead
    s = Scaler(p, 1, 0)
    reasons = set()
    for t in range(0, 200):
        s.observe(float(t), max(0.0, 5.0 + 0.5 * t + rng.gauss(0.0, 4.5)))
        reasons.add(s.decide(float(t), 90.0).reason)
    assert a.AHEAD in reasons


def test_headroom_adds_square_root_spare_slots():
    """Square-root staffing: 36 in flight at a batch of 16 is 3 replicas without headroom; with 3
    deviations (18 spare) 4; the spare shrinks against the load as it grows (400: 25 + 4 replicas)."""
    assert a.wanted(policy(target=16, max=40), 36) == 3
    assert a.wanted(policy(target=16, max=40, headroom=3), 36) == 4
    assert a.wanted(policy(target=16, max=40, headroom=3), 400) == 29
    assert a.wanted(policy(target=16, headroom=3), 0) == 0
    s = Scaler(policy(target=16, max=40, headroom=3), 3, 0)
    d = feed(s, 0, 120, 36)
    assert (d.desired, d.wanted) == (4, 4) and "plus 3 x sqrt(in flight) spare" in d.explain(s.policy)


def test_a_scale_up_is_held_to_the_rate_times_the_replicas_serving():
    """Requests queue while new replicas load: without the cap each pass takes the queue for more
    demand and asks again (up to max); with it, 2 x the Ready replicas until they serve."""
    capped = Scaler(policy(max=32, max_scale_up_rate=2), 2, 0)
    free = Scaler(policy(max=32), 2, 0)
    for t in range(0, 30):
        load = 8 + 4 * t  # the queue grows while the new replicas load
        for s in (capped, free):
            s.observe(t, load)
        d = capped.decide(t, ready=2)
        free.decide(t, ready=2)
    assert (capped.desired, d.reason) == (4, a.RATE) and d.wanted > 4
    assert free.desired >= 12
    capped.observe(31, 130)
    assert capped.decide(31, ready=4).desired == 8  # the first ones serve: the next step
    assert Scaler(policy(max_scale_up_rate=2), 1, 0).decide(0, ready=0).reason == a.NO_SIGNAL
    lone = Scaler(policy(max_scale_up_rate=2), 1, 0)
    lone.observe(0, 40)
    assert lone.decide(1, ready=0).desired == 2  # none serving yet: counted as one
    assert lone.decide(2).desired > 2  # the ready count unknown: no cap


def test_a_dip_between_busy_spells_keeps_the_replicas_the_next_spell_needs():
    """A scale-down goes no lower than the most any decision wanted over the last cooldown. Before,
    a dip of one stable window drained to what the dip wanted, and the next spell's scale-up,
    within a cooldown of that reversal, was refused while its queue grew."""
    p = policy(stable_window=10, panic_window=2, scale_down_cooldown=60, max_step=10, max=20,
               scale_down_stabilization=60)
    s = Scaler(p, 1, 0)
    feed(s, 0, 70, 32)  # busy: 8 replicas
    assert s.desired == 8
    d = feed(s, 71, 100, 4)  # a 30 s dip that wants 1
    assert (s.desired, d.reason) == (8, a.HOLD)
    d = feed(s, 101, 130, 32)  # the next spell finds its replicas
    assert s.desired == 8
    d = feed(s, 131, 400, 4)  # a lasting dip: down once the busy wants leave the window
    assert s.desired == 1 and s.decision.reason != a.HOLD
    free = Scaler(dataclasses.replace(p, scale_down_stabilization=0), 1, 0)  # off: the dip drains
    feed(free, 0, 70, 32)
    feed(free, 71, 100, 4)
    assert free.desired < 8


def test_min_zero_scales_to_zero_only_after_a_whole_stable_window_idle():
    s = Scaler(policy(min=0, scale_down_cooldown=10, stable_window=20, panic_window=2), 1, 0)
    feed(s, 0, 25, 1)  # one request in flight all along: one replica
    assert s.desired == 1
    s.observe(26, 0)
    d = s.decide(40)  # 14 s idle: the window still saw the request
    assert (s.desired, d.reason) == (1, a.STABLE)
    d = feed(s, 41, 47, 0)  # 21 s idle: a whole stable window with nothing in flight
    assert (s.desired, d.reason) == (0, a.STABLE)


def test_demand_at_zero_starts_a_replica_even_within_a_cooldown_of_a_reversal():
    """Up, down, down to zero: a request held for the deployment then is a reversal within a cooldown
    of the last one, which the rule refuses for a deployment that has replicas; at zero nothing else
    would serve the request, so it is never refused there."""
    s = Scaler(policy(min=0, max=10, scale_down_cooldown=30, stable_window=5, panic_window=1, max_step=10), 1, 0)
    feed(s, 0, 10, 20)  # up to 5
    t = 11
    while s.desired != 0:  # down after the cooldown: a reversal; then on to zero
        s.observe(t, 0)
        s.decide(t)
        t += 1
    assert s.last_reversal_at is not None and t - 1 - s.last_reversal_at < 30
    s.observe(t, 1)  # one request held: up from zero at once, on the sample just taken
    assert (s.decide(t).reason, s.desired) == (a.FROM_ZERO, 1)
