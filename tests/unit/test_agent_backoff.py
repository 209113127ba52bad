"""Reconnect backoff: exponential ceiling, capped, full jitter (no lockstep)."""

import random
import statistics

import pytest

from llmgw.agent.backoff import Backoff, ceiling, full_jitter


def test_ceiling_doubles_from_initial_and_caps_at_max():
    assert [ceiling(a, 1.0, 30.0) for a in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert ceiling(10_000, 0.5, 60.0) == 60.0  # no overflow after a very long outage
    with pytest.raises(ValueError):
        ceiling(-1, 1.0, 30.0)


def test_every_delay_lies_within_zero_and_the_ceiling():
    rng = random.Random(7)
    for attempt in range(12):
        for _ in range(200):
            d = full_jitter(attempt, 0.5, 20.0, rng)
            assert 0.0 <= d <= ceiling(attempt, 0.5, 20.0)


def test_a_fleet_does_not_retry_in_lockstep():
    # 500 agents losing the control plane at the same instant: their first
    # retries spread over the whole window instead of arriving together.
    delays = [Backoff(2.0, 60.0, rng=random.Random(seed)).next_delay() for seed in range(500)]
    assert len({round(d, 6) for d in delays}) > 490
    assert 0.8 < statistics.mean(delays) < 1.2  # uniform on [0, 2]
    low = sum(d < 1.0 for d in delays) / len(delays)
    assert 0.4 < low < 0.6


def test_attempts_grow_and_reset_after_a_connection_worked():
    b = Backoff(1.0, 8.0, rng=random.Random(1))
    for _ in range(6):
        b.next_delay()
    assert b.attempt == 6
    late = [full_jitter(6, 1.0, 8.0, random.Random(s)) for s in range(200)]
    assert max(late) > 4.0  # the ceiling grew to the cap
    b.reset()
    assert b.attempt == 0
    assert b.next_delay() <= 1.0
