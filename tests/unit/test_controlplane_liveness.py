"""Liveness apart from the control plane's loop latency: stall accounting, admission, stopping on time."""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import pytest

from llmgw.agent.backoff import Backoff
from llmgw.agent.stream import MAX_RETRY_AFTER, StreamClient
from llmgw.controlplane.admission import BURST_FACTOR, DROP, LOADED_HOLD, LOADED_LAG, RUN, WAIT, Admission
from llmgw.controlplane.lifecycle import NodeClock, NodeState, evaluate, excuse, half_open
from llmgw.controlplane.looplag import LoopLag
from llmgw.controlplane.state import PASS_SHARE, PASS_SHARE_SHEDDING, SHEDDING_HOLD, ControlPlane
from llmgw.settings import Lifecycle
from cp_state_fakes import Clock, FakeSession, register, settings


def test_a_cancellation_that_lands_with_a_kick_still_stops_the_loop():
    """CPython gh-86296: before 3.12, ``asyncio.wait_for`` lost a cancellation that came in the same
    iteration as the awaited event; the control plane then ran on after SIGTERM while agents registered."""
    async def scenario() -> int:
        stopped = 0
        for _ in range(30):
            cp = ControlPlane(settings(replicas=0))
            task = asyncio.get_running_loop().create_task(cp.run(interval=5.0))
            for _ in range(3):
                await asyncio.sleep(0)
            cp.kick()  # the event the loop waits on is set ...
            task.cancel()  # ... and the stop comes in the same iteration
            done, _ = await asyncio.wait({task}, timeout=2.0)
            if done and task.cancelled():
                stopped += 1
            else:
                task.cancel()
                await asyncio.wait({task}, timeout=2.0)
        return stopped

    assert asyncio.run(scenario()) == 30


def test_a_wake_up_overdue_now_is_counted_once():
    clock = Clock()
    lag = LoopLag(period=0.25, clock=clock)
    assert lag.take() == 0.0
    lag._due = clock.t + 0.25  # the sampler is asleep
    clock.t += 30.25  # ... and the process was stopped for 30 s
    assert lag.take() == pytest.approx(30.0)
    assert lag.behind() == pytest.approx(30.0)
    clock.t += 0.5
    assert lag.take() == pytest.approx(0.5)  # only what is new since
    lag._woke(lag._due)  # the sampler runs at last: nothing it measured is handed out twice
    assert lag.take() == 0.0 and lag.lag == pytest.approx(30.5)


def test_a_stall_extends_every_deadline_by_itself():
    lc = Lifecycle(unreachable_after=30, lost_after=120, startup_grace=0)
    clocks = {"a": NodeClock.seen(100.0), "b": NodeClock.seen(80.0)}
    excuse(clocks.values(), 40.0, now=145.0)  # the control plane stopped for 40 s
    ev = evaluate(clocks, 145.0, 0.0, lc)
    assert ev.transitions == ()  # a was silent 5 s of its own, b 25 s
    ev = evaluate(clocks, 151.0, 0.0, lc)
    assert [(t.node_id, t.new) for t in ev.transitions] == [("b", NodeState.UNREACHABLE)]
    assert clocks["a"].last_seen == 140.0 and clocks["b"].last_seen == 120.0
    excuse(clocks.values(), 1000.0, now=151.0)
    assert clocks["a"].last_seen == 151.0  # never past now


def test_the_control_planes_stall_does_not_make_its_nodes_unreachable():
    clock = Clock()
    cp = ControlPlane(settings(replicas=0), clock=clock)
    cp.looplag = LoopLag(clock=clock)
    cp.register(register("n1"), FakeSession())
    cp.looplag._due = clock.t + 0.25
    clock.t += 60.0  # stopped for a minute: past unreachable_after (3 s) and lost_after (6 s)
    cp.tick()
    assert cp.nodes["n1"].clock.state is NodeState.READY and cp.stalled == pytest.approx(59.75)
    cp.looplag._woke(cp.looplag._due)  # the sampler wakes, and keeps time from now on
    clock.t += 4.0  # then a silence of its own
    cp.tick()
    assert cp.nodes["n1"].clock.state is NodeState.UNREACHABLE


def test_a_stream_that_carries_not_even_a_ping_for_two_ping_intervals_is_closed():
    clock = Clock()
    cp = ControlPlane(settings(replicas=0, keepalive_interval=1.5), clock=clock)
    pinging, dead = FakeSession(), FakeSession()
    cp.register(register("pinging"), pinging)
    cp.register(register("dead"), dead)
    for _ in range(5):  # heartbeats stop on both; pings go on from one
        clock.t += 1.0
        cp.frame("pinging", pinging.epoch)
        cp.tick()
    assert pinging.closed is None and dead.closed and "not even a ping" in dead.closed
    assert half_open(cp.nodes["dead"].clock, clock.t, cp.lifecycle())
    assert cp.nodes["pinging"].clock.state is NodeState.UNREACHABLE  # silent all the same: pings are not heartbeats


def test_the_liveness_told_to_agents_scales_with_the_fleet():
    lc = Lifecycle(heartbeat_interval=5, keepalive_interval=10, stream_grace=60, max_heartbeats_per_second=500)
    big = lc.for_fleet(10_000)
    assert big.heartbeat_interval == 20 and big.keepalive_interval == 40 and big.stream_grace == 75
    assert lc.for_fleet(100) is lc


def test_admission_admits_at_its_rate_and_sizes_the_retry_to_the_crowd():
    a = Admission()
    admitted = [a.decide(0.0, rate=10, lag=0.0, max_lag=1.0) for _ in range(30)]
    assert admitted[:10] == [None] * 10  # one second's burst
    refused = admitted[10:]
    assert all(r is not None and r >= 1 for r in refused) and refused[-1] == 2  # 20 waiting / 10 a second
    assert a.decide(0.5, rate=10, lag=0.0, max_lag=1.0) is None  # half a second refills five
    assert a.admitted == 11 and a.refused == 20


def test_admission_refuses_while_the_loop_runs_late_unless_the_handshake_is_paid():
    a = Admission()
    assert a.decide(0.0, rate=100, lag=3.5, max_lag=1.0) == 3
    assert a.decide(0.1, rate=100, lag=0.2, max_lag=1.0) is None
    # through TLS the lag was judged before the handshake: refusing now would buy a second one
    assert a.decide(0.2, rate=100, lag=3.5, max_lag=1.0, handshake_paid=True) is None
    assert a.admitted == 2 and a.refused == 1
    # the rate still holds for it
    slow = Admission()
    assert slow.decide(0.0, rate=1, lag=0.0, max_lag=1.0, handshake_paid=True) is None
    assert slow.decide(0.0, rate=1, lag=0.0, max_lag=1.0, handshake_paid=True) == 1


def test_a_reconcile_pass_that_holds_the_loop_is_not_read_as_overload():
    """A pass over a large fleet on a slow core holds the loop for seconds, paced to half of it:
    admission must not drop handshakes for it, while the heartbeat deadlines still move by it."""
    clock = Clock()
    lag = LoopLag(period=0.25, clock=clock)
    lag._due = clock.t + 0.25
    clock.t += 2.25  # a 2 s pass ...
    lag.held(2.0)  # ... that said so
    assert lag.behind() == pytest.approx(0.0)
    assert lag.take() == pytest.approx(2.0)  # no heartbeat was read meanwhile
    clock.t += 0.5  # and 0.5 s more that nobody accounts for: overload
    assert lag.behind() == pytest.approx(0.5)
    lag._woke(lag._due)
    assert lag.lag == pytest.approx(0.5) and lag.behind() == pytest.approx(0.5)


def test_the_control_planes_own_pass_tells_the_lag_it_held_the_loop():
    """Through ``ControlPlane.run``: a tick that holds the loop 1.5 s leaves admission's reading low."""
    async def scenario() -> tuple[float, float]:
        cp = ControlPlane(settings(replicas=0))
        real = cp.tick
        calls = []

        def slow_tick():
            if not calls:
                time.sleep(1.5)
            calls.append(1)
            return real()

        cp.tick = slow_tick  # type: ignore[method-assign]
        task = asyncio.get_running_loop().create_task(cp.run(interval=0.1))
        while not calls:
            await asyncio.sleep(0.01)
        behind, taken = cp.looplag.behind(), cp.stalled
        task.cancel()
        await asyncio.wait({task}, timeout=2.0)
        return behind, taken

    behind, taken = asyncio.run(scenario())
    assert behind < 0.5  # the pass said it held the loop
    assert taken > 1.0  # the heartbeat deadlines moved by it all the same


def test_handshakes_run_at_most_so_many_at_once_and_a_trickle_while_the_loop_lags():
    """A refusal after a TLS handshake still costs the handshake: while the loop runs behind, or a burst
    of handshakes is under way, beyond max_tls_handshakes running a new connection waits, unread, for
    one to end; while the loop lags past max_loop_lag (every stream refused anyway), all but a trickle
    are dropped at accept."""
    a, cap = Admission(), Lifecycle().max_tls_handshakes
    behind = LOADED_LAG
    assert {a.handshake(0.0, rate=10, lag=behind, max_lag=1.0, in_flight=n, cap=cap)
            for n in range(cap)} == {RUN}
    assert a.handshake(0.0, rate=10, lag=behind, max_lag=1.0, in_flight=cap, cap=cap) == WAIT
    # caught up for a moment: the cap holds a while, so hundreds of handshakes do not start at once
    assert a.handshake(LOADED_HOLD - 0.1, rate=10, lag=0.0, max_lag=1.0, in_flight=cap, cap=cap) == WAIT
    # a loop keeping time, no burst: no cap
    assert a.handshake(LOADED_HOLD, rate=10, lag=0.0, max_lag=1.0, in_flight=cap, cap=cap) == RUN
    # a fleet dialling at once is accepted before the loop can read as behind: the burst is the load
    assert a.handshake(20.0, rate=10, lag=0.0, max_lag=1.0, in_flight=BURST_FACTOR * cap, cap=cap) == WAIT
    assert a.handshake(20.0 + LOADED_HOLD - 0.1, rate=10, lag=0.0, max_lag=1.0,
                       in_flight=cap, cap=cap) == WAIT
    assert a.shed == 0  # none dropped while the loop keeps time
    assert a.handshake(21.0, rate=10, lag=3.0, max_lag=1.0, in_flight=cap, cap=cap) == DROP
    assert a.shed == 1
    lagging = [a.handshake(30.0, rate=100, lag=3.0, max_lag=1.0, in_flight=0, cap=cap) for _ in range(100)]
    assert lagging.count(RUN) == 5 and lagging.count(DROP) == 95 and a.shed == 96  # 5 % of the rate
    assert a.handshake(30.0, rate=10, lag=3.0, max_lag=1.0, in_flight=0, cap=cap) == DROP
    assert a.handshake(31.0, rate=10, lag=3.0, max_lag=1.0, in_flight=0, cap=cap) == RUN  # never below one a second
    assert {a.handshake(31.0, rate=10, lag=0.5, max_lag=1.0, in_flight=0, cap=cap) for _ in range(100)} == {RUN}  # caught up


def test_a_refused_agent_waits_as_told_with_jitter():
    b = Backoff(1.0, 30.0, rng=random.Random(3))
    delays = [b.told(4.0) for _ in range(200)]
    assert min(delays) >= 4.0 and max(delays) <= 8.0 and max(delays) - min(delays) > 2.0

    def refusal(status: int, retry: str | None) -> aiohttp.WSServerHandshakeError:
        return aiohttp.WSServerHandshakeError(None, (), status=status,  # type: ignore[arg-type]
                                              headers={} if retry is None else {"Retry-After": retry})

    assert StreamClient._retry_after(refusal(503, "7")) == 7.0
    assert StreamClient._retry_after(refusal(503, "99999")) == MAX_RETRY_AFTER
    assert StreamClient._retry_after(refusal(503, "Wed, 21 Oct 2015 07:28:00 GMT")) is None
    assert StreamClient._retry_after(refusal(503, None)) is None
    assert StreamClient._retry_after(refusal(403, "7")) is None


def test_a_standby_spreads_the_agents_it_refuses_over_the_rate_a_leader_admits():
    """Every agent of a dead leader's fleet reaches a standby within a lease: told to come back at
    once, they would hammer it with handshakes; told the same long delay, they would all return in
    the second it takes over.  Each is told the crowd refused of late over the admission rate."""
    a = Admission()
    told = [a.refuse(100.0 + i / 1000, rate=100) for i in range(1000)]  # a thousand agents in one second
    assert told[0] == 1 and told[-1] == 10 and told == sorted(told)
    assert a.refuse(200.0, rate=100) == 1  # a lone agent much later is not kept away
    assert a.refused == 1001 and a.admitted == 0


def test_passes_take_less_of_the_loop_while_agents_are_turned_away_at_the_door():
    """Each pass walks the whole fleet whatever arrived since the last: while dials are dropped
    before their handshake, a long pass is followed by four times its length for the agents."""
    async def scenario(shed: bool) -> tuple[float, float]:
        cp = ControlPlane(settings(replicas=0))
        real = cp.tick

        def slow_tick():
            time.sleep(0.2)
            return real()

        cp.tick = slow_tick  # type: ignore[method-assign]
        if shed:
            cp.arriving("shed")
        task = asyncio.get_running_loop().create_task(cp.run(interval=0.05))
        while cp.pass_pause == (0.0, 0.0):
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.wait({task}, timeout=2.0)
        return cp.pass_pause

    spent, pause = asyncio.run(scenario(shed=True))
    assert pause == pytest.approx(4 * spent)
    spent, pause = asyncio.run(scenario(shed=False))
    assert pause == pytest.approx(spent)


def test_the_shedding_share_lapses_when_no_dial_was_dropped_of_late():
    clock = Clock()
    cp = ControlPlane(settings(replicas=0), clock=clock)
    assert cp.pass_share() == PASS_SHARE
    cp.arriving("shed")
    assert cp.pass_share() == PASS_SHARE_SHEDDING
    cp.arriving("admitted")  # an agent let in says nothing of the door
    clock.t += SHEDDING_HOLD
    assert cp.pass_share() == PASS_SHARE


def test_passes_take_the_small_share_while_the_startup_grace_holds():
    """Nothing is placed in a grace, so its passes yield the loop to the registrations that end it."""
    clock = Clock()
    cp = ControlPlane(settings(replicas=1, startup_grace=30), clock=clock)
    cp.tick()
    assert cp.timers.evaluation.in_grace
    assert cp.pass_share() == PASS_SHARE_SHEDDING  # before: PASS_SHARE
    clock.t += 31
    cp.tick()
    assert not cp.timers.evaluation.in_grace
    assert cp.pass_share() == PASS_SHARE
