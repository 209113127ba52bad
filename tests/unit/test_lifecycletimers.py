"""The startup grace holds while agents are still arriving, never past MAX_GRACE_FACTOR x startup_grace.

After a restart, agents that the per-source connection cap turned away, whose
TLS handshake timed out, or that wait out their own backoff are alive and
about to register; the grace must not end under them (a 10,000-node storm on
a starved host re-placed 5,062 healthy replicas that way).  A fake clock
throughout: ``now`` is passed in.
"""

from __future__ import annotations

import logging

import pytest

from llmgw.controlplane.lifecycle import NodeClock
from llmgw.controlplane.lifecycletimers import ARRIVALS, MAX_GRACE_FACTOR, LifecycleTimers
from llmgw.settings import Lifecycle

LC = Lifecycle(startup_grace=10.0)


def test_with_no_agent_arriving_the_grace_is_startup_grace():
    timers = LifecycleTimers(started_at=100.0)
    assert timers.grace_end(LC) == 110.0
    assert timers.grace_left(104.0, LC) == 6.0


@pytest.mark.parametrize("kind", sorted(ARRIVALS))
def test_any_arrival_during_the_grace_holds_it_for_startup_grace_after_it(kind):
    timers = LifecycleTimers(started_at=100.0)
    timers.note_arrival(101.0, kind, LC)  # the usual restart: agents back in its first seconds
    assert timers.grace_end(LC) == 111.0
    timers.note_arrival(109.0, kind, LC)  # still arriving at the end of the grace: held
    assert timers.grace_end(LC) == 119.0
    timers.note_arrival(118.0, kind, LC)  # and again, inside the extension
    assert timers.grace_end(LC) == 128.0
    assert timers.arrivals[kind] == 3


def test_agents_arriving_without_end_hold_it_only_up_to_the_limit():
    timers = LifecycleTimers(started_at=100.0)
    now = 100.0
    while now < 200.0:
        timers.note_arrival(now, "capped", LC)
        now += 1.0
    limit = 100.0 + MAX_GRACE_FACTOR * 10.0
    assert timers.grace_end(LC) == limit
    assert timers.arrivals["capped"] == int(limit - 100.0), "arrivals after the limit are not counted"


def test_arrivals_after_the_grace_ended_change_nothing():
    timers = LifecycleTimers(started_at=100.0)
    timers.note_arrival(111.0, "registered", LC)  # a settled fleet's node flapping: judged as always
    timers.note_arrival(111.0, "capped", LC)
    assert timers.grace_end(LC) == 110.0 and timers.arrivals == dict.fromkeys(ARRIVALS, 0)
    extended = LifecycleTimers(started_at=100.0)
    extended.note_arrival(109.0, "timed_out", LC)
    extended.note_arrival(120.0, "capped", LC)  # a quiet startup_grace went by: over, for good
    assert extended.grace_end(LC) == 119.0


def test_a_refusal_holds_the_grace_for_its_retry_after_and_as_an_arrival():
    timers = LifecycleTimers(started_at=100.0)
    timers.note_refused(109.0, 20.0, LC)  # told to come back in 20 s: due by 149, capped at 140
    assert timers.grace_end(LC) == 140.0 and timers.arrivals["refused"] == 1
    short = LifecycleTimers(started_at=100.0)
    short.note_refused(109.0, 1.0, LC)  # back within 2 s, but others may still be in line
    assert short.grace_end(LC) == 119.0


def test_no_grace_means_no_hold():
    lc = Lifecycle(startup_grace=0.0)
    timers = LifecycleTimers(started_at=100.0)
    timers.note_arrival(100.0, "registered", lc)
    assert timers.grace_end(lc) == 100.0 and not timers.arrivals["registered"]


def test_a_takeover_starts_a_fresh_grace_with_nothing_carried_over():
    timers = LifecycleTimers(started_at=100.0)
    timers.note_arrival(109.0, "capped", LC)
    timers.restart(200.0)
    assert timers.grace_end(LC) == 210.0 and timers.arrivals == dict.fromkeys(ARRIVALS, 0)


def test_the_grace_is_judged_held_while_arrivals_continue_and_logged_once_held_and_once_over(caplog):
    timers = LifecycleTimers(started_at=100.0)
    clocks = {"a": NodeClock.seen(101.0)}
    with caplog.at_level(logging.INFO, "llmgw.controlplane"):
        timers.note_arrival(101.0, "registered", LC)
        for t in range(101, 126):
            if t < 116 and t % 2:
                timers.note_arrival(float(t), "capped", LC)  # aborted at the cap, back within its backoff
            clocks["a"].last_seen = float(t)
            timers.evaluate(clocks, float(t), LC)
            assert timers.evaluation.in_grace == (t < 125), t
    lines = [r.getMessage() for r in caplog.records]
    held = [line for line in lines if "held past startup_grace" in line]
    over = [line for line in lines if "startup grace over" in line]
    assert len(held) == 1 and len(over) == 1, lines
    assert "agents still arriving" in held[0] and "1 registered" in held[0]
    assert "no agent arriving for startup_grace 10s" in over[0]
    assert "1 registered" in over[0] and "8 dials aborted at max_connections_per_source" in over[0]


def test_a_grace_held_to_its_limit_says_so(caplog):
    timers = LifecycleTimers(started_at=100.0)
    clocks: dict[str, NodeClock] = {}
    with caplog.at_level(logging.INFO, "llmgw.controlplane"):
        for t in range(100, 145):
            timers.note_arrival(float(t), "timed_out", LC)
            timers.evaluate(clocks, float(t), LC)
    (over,) = [r for r in caplog.records if "startup grace over" in r.getMessage()]
    assert over.levelno == logging.WARNING and "held to its limit" in over.getMessage()


def test_a_restart_whose_agents_are_back_in_time_says_only_that_the_grace_is_over(caplog):
    timers = LifecycleTimers(started_at=100.0)
    clocks = {"a": NodeClock.seen(100.5)}
    with caplog.at_level(logging.INFO, "llmgw.controlplane"):
        timers.note_arrival(100.5, "registered", LC)
        for t in range(100, 115):
            clocks["a"].last_seen = float(t)
            timers.evaluate(clocks, float(t), LC)
    lines = [r.getMessage() for r in caplog.records]
    assert not [line for line in lines if "held past" in line], lines
    (over,) = [line for line in lines if "startup grace over" in line]
    assert over.startswith("startup grace over after 11.0s"), over


def test_the_first_control_plane_on_a_store_waits_startup_grace_alone_and_a_takeover_after_a_run_is_held(caplog):
    """No earlier run on the store (no epoch handed out): nothing was placed anywhere, so agents
    arriving do not hold the grace (a first rollout starts its agents while the grace runs, and
    would wait startup_grace more after the last); refusals still do, as before."""
    timers = LifecycleTimers(started_at=100.0, after_a_run=False)
    timers.note_arrival(108.0, "registered", LC)
    assert timers.grace_end(LC) == 110.0
    timers.note_refused(109.0, 3.0, LC)
    assert timers.grace_end(LC) == 115.0  # 2 x Retry-After
    with caplog.at_level(logging.INFO, logger="llmgw.controlplane"):
        timers.evaluate({}, 116.0, LC)
    assert "the first control plane on this store" in caplog.text
    timers.restart(200.0, after_a_run=True)  # leading after one ran: arrivals hold it again
    timers.note_arrival(209.0, "registered", LC)
    assert timers.grace_end(LC) == 219.0
