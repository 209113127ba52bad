"""The parts ``ControlPlane`` and ``llmgw server`` compose, each on its own: when a pass runs, who
hears of endpoints, what is logged about waiting slots, how the lifecycle's clocks excuse the
control plane's stalls, and what taking or losing the lead does.

``test_controlplane_state.py`` and ``test_controlplane_liveness.py`` drive them together
through ``ControlPlane``; these pin each part's own rule.
"""

from __future__ import annotations

import asyncio
import logging

from cp_state_fakes import Clock, settings

from llmgw.controlplane.endpointfeed import EndpointFeed, Published
from llmgw.controlplane.leadership import LeaderHooks
from llmgw.controlplane.lifecycle import NodeClock
from llmgw.controlplane.lifecycletimers import MAX_GRACE_FACTOR, STALL_EXCUSED_FROM, LifecycleTimers
from llmgw.controlplane.passgate import FULL_PASS_EVERY, PassGate
from llmgw.controlplane.state import ControlPlane
from llmgw.controlplane.store import StoreError
from llmgw.controlplane.unplacedlog import UnplacedLog
from llmgw.settings import Lifecycle


def test_a_settled_fleet_is_passed_whole_only_on_news_or_every_full_pass_period():
    gate = PassGate()
    assert gate.open(0.0), "the first tick reconciles"
    gate.settled = True
    assert not gate.open(1.0)
    gate.mark()
    assert not gate.woken.is_set() and gate.open(2.0), "found during a tick: due, the loop is not woken"
    gate.kick()
    assert gate.woken.is_set() and gate.open(3.0)
    assert not gate.open(3.0 + FULL_PASS_EVERY - 0.1)
    assert gate.open(3.0 + FULL_PASS_EVERY)
    gate.settled = False
    assert gate.open(3.0 + FULL_PASS_EVERY), "work left undone: every tick"


def test_endpoints_reach_every_listener_once_per_change_even_when_one_fails():
    feed, heard = EndpointFeed(), []

    def broken(published):
        if published.endpoints:
            raise RuntimeError("listener bug")

    feed.subscribe(broken, Published([]))
    feed.subscribe(heard.append, Published([]))
    eps = [{"model": "m", "url": "http://10.0.0.1:1", "draining": False}]
    feed.publish(Published(eps))
    feed.publish(Published(list(eps)))
    feed.publish(Published(list(eps), ("z",)))
    assert heard == [Published([]), Published(eps), Published(eps, ("z",))], \
        "an unchanged set is not handed out again; a failing listener stops no other"


def test_waiting_slots_are_logged_once_per_deployment_and_reason(caplog):
    log = UnplacedLog()
    unplaced = {("m/p", n): "no GPU free" for n in range(7)} | {("m/p", 9): "restarting in 3s (failure 1)"}
    with caplog.at_level(logging.WARNING, "llmgw.controlplane"):
        log.log(unplaced)
        log.log(dict(unplaced))
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == "m/p: 7 replica(s) not placed, slot(s) #0, #1, #2, #3, #4 and 2 more: no GPU free"


class _Lag:
    def __init__(self, *late: float):
        self.late = list(late)

    def take(self) -> float:
        return self.late.pop(0)


def test_loop_lateness_is_excused_once_it_adds_up_and_a_larger_fleet_stretches_the_timings():
    timers = LifecycleTimers(started_at=0.0)
    small = STALL_EXCUSED_FROM * 0.6
    timers.looplag = _Lag(small, small)
    clocks = {"a": NodeClock.seen(0.0)}
    timers.excuse_stall(clocks, 1.0)
    assert timers.stalled == 0.0 and clocks["a"].last_seen == 0.0
    timers.excuse_stall(clocks, 1.0)
    assert timers.stalled == 2 * small and clocks["a"].last_seen > 0.0
    lc = Lifecycle(max_heartbeats_per_second=10)
    timers.grown_to(1000, lc)
    timers.grown_to(10, lc)
    assert lc.for_fleet(1000) != lc.for_fleet(10)
    assert timers.lifecycle(lc) == lc.for_fleet(1000), "a timing never shrinks below what nodes were told"


def test_a_growing_fleet_says_its_heartbeat_interval_once_a_second_of_growth(caplog):
    timers = LifecycleTimers(started_at=0.0)
    lc = Lifecycle(heartbeat_interval=5.0, max_heartbeats_per_second=500)
    with caplog.at_level(logging.INFO, logger="llmgw.controlplane"):
        for n in range(1, 10_001):  # nodes registering one by one: past 2,500 each one stretches the interval
            timers.grown_to(n, lc)
    said = [r.getMessage() for r in caplog.records if "heartbeat every" in r.getMessage()]
    assert said[0].startswith("2501 nodes: heartbeat every 5.0s")
    assert said[-1].startswith("10000 nodes: heartbeat every 20.0s")
    assert len(said) == 16, said  # leaving 5 s, then reaching 6, 7 ... 20 s; before: 7,500 lines


def test_the_startup_grace_holds_while_agents_refused_during_it_are_due_back():
    lc = Lifecycle(startup_grace=10.0)
    timers = LifecycleTimers(started_at=100.0)
    assert timers.grace_end(lc) == 110.0
    timers.note_refused(105.0, 8, lc)  # told to come back within 8 s: due by 121 at the latest
    assert timers.grace_end(lc) == 121.0 and timers.grace_left(115.0, lc) == 6.0
    timers.note_refused(120.0, 30, lc)  # still refusing: held, but never past MAX_GRACE_FACTOR x startup_grace
    assert timers.grace_end(lc) == 100.0 + MAX_GRACE_FACTOR * 10.0
    clocks = {"a": NodeClock.seen(100.0)}
    assert timers.evaluate(clocks, 125.0, lc) and timers.evaluation.in_grace
    late = LifecycleTimers(started_at=100.0)
    late.note_refused(111.0, 30, lc)  # after the grace ended: a settled fleet is judged as always
    assert late.grace_end(lc) == 110.0
    late.restart(200.0)
    assert late.grace_end(lc) == 210.0


class _Elector:
    def __init__(self):
        self.is_leader, self.on_change, self.resigned = False, None, 0

    async def resign(self):
        self.resigned += 1


def test_leader_hooks_take_over_on_leading_and_stop_the_process_when_deposed():
    clock, elector, stop = Clock(), _Elector(), asyncio.Event()
    cp = ControlPlane(settings(), clock=clock)
    hooks = LeaderHooks(cp, elector, stop)
    assert not cp.authority(), "a standby acts on nothing"
    elector.is_leader = True
    clock.t = 1050.0
    elector.on_change(True, 7)
    assert cp.authority() and cp.leader_fields() == {"leader_epoch": 7} and cp.started_at == 1050.0

    def unreadable():
        raise StoreError("etcd unreachable")

    async def lead_blind():
        cp.store.reload = unreadable
        elector.on_change(True, 8)
        await asyncio.sleep(0)

    asyncio.run(lead_blind())
    assert elector.resigned == 1 and cp.leader_epoch == 7, "a store it cannot read: the lead is given up"
    assert not hooks.deposed and not stop.is_set()
    elector.on_change(False, 7)
    assert hooks.deposed and stop.is_set()
