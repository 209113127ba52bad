"""Scale to sleep's decisions on a fake clock: which replica sleeps or wakes, and when it is asked again."""

from __future__ import annotations

import dataclasses

from reconciler_fleet import Fleet, catalog, make_ready

from llmgw.catalog import Autoscale, Catalog, Sleep
from llmgw.controlplane.autoscale_sleep import Sleep as SleepAction
from llmgw.controlplane.autoscale_sleep import SleepPlanner, Wake
from llmgw.controlplane.reconcile.observe import observe_status

KEY = "tiny/sim"


def sleepy(replicas: int = 1, after: float = 30.0, level: int = 1, **kw) -> Catalog:
    cat = catalog(replicas=replicas)
    (dep,) = cat.deployments
    policy = Autoscale(**{"max": 4, "min": replicas, "sleep": Sleep(after, level), **kw})
    return dataclasses.replace(cat, deployments=(dataclasses.replace(dep, autoscale=policy),))


def ready_fleet(cat: Catalog, n: int, say_sleeping: bool = True) -> Fleet:
    """``n`` Ready replicas; ``say_sleeping``: their agents have said they are awake, as an agent does once the
    control plane accepts the field."""
    f = Fleet("a", "b", gpus=1)
    f.step(cat, 0.0, replica_counts={KEY: n})
    make_ready(f, 0.5)
    f.step(cat, 0.5, replica_counts={KEY: n})
    if say_sleeping:
        for r in f.rec.book.replicas.values():
            s = r.shards[0]
            observe_status(f.rec.book, s.node_id, {"type": "shard_status", "shard_id": s.shard_id,
                                                   "state": "ready", "sleeping": False}, 0.5)
    return f


def report(f: Fleet, action, sleeping: bool, now: float) -> None:
    """The agent's shard_status after it called the engine."""
    observe_status(f.rec.book, action.node_id, {"type": "shard_status", "shard_id": action.shard_id,
                                                "state": "ready", "sleeping": sleeping}, now)


def test_an_idle_deployment_at_its_min_sleeps_after_the_idle_time_and_wakes_on_traffic():
    cat = sleepy(after=30, level=2)
    f = ready_fleet(cat, 1)
    p = SleepPlanner()
    p.observe(KEY, 1.0, 0)  # first sighting starts the idle clock
    assert p.decide(cat, f.rec.book, {KEY: 1}, 20.0) == []
    p.observe(KEY, 20.0, 3)  # traffic restarts it
    assert p.decide(cat, f.rec.book, {KEY: 1}, 49.0) == []
    (act,) = p.decide(cat, f.rec.book, {KEY: 1}, 50.0)
    (r,) = f.rec.book.replicas.values()
    assert act == SleepAction(r.shards[0].node_id, r.shards[0].shard_id, r.replica_id, 2)
    assert act.message() == {"type": "sleep", "shard_id": r.shards[0].shard_id, "level": 2}
    assert p.decide(cat, f.rec.book, {KEY: 1}, 51.0) == []  # asked already, not again
    report(f, act, True, 52.0)
    assert r.shards[0].sleeping and p.decide(cat, f.rec.book, {KEY: 1}, 60.0) == []
    p.wake_requested(p.sleeping_keys(cat, "tiny"), 61.0)  # a router holds a request
    (wake,) = p.decide(cat, f.rec.book, {KEY: 1}, 61.0)
    assert wake == Wake(act.node_id, act.shard_id, r.replica_id) and wake.message()["type"] == "wake"
    report(f, wake, False, 61.5)
    assert not r.shards[0].sleeping and p.decide(cat, f.rec.book, {KEY: 1}, 62.0) == []


def test_above_its_min_nothing_sleeps_and_replicas_sleep_one_at_a_time():
    cat = sleepy(replicas=2, after=10)
    f = ready_fleet(cat, 2)
    p = SleepPlanner()
    p.observe(KEY, 0.0, 0)
    assert p.decide(cat, f.rec.book, {KEY: 3}, 20.0) == []  # the autoscaler wants more than min
    (first,) = p.decide(cat, f.rec.book, {KEY: 2}, 20.0)
    assert p.decide(cat, f.rec.book, {KEY: 2}, 21.0) == []  # the second waits for the first's report
    report(f, first, True, 21.0)
    (second,) = p.decide(cat, f.rec.book, {KEY: 2}, 22.0)
    assert second.replica_id != first.replica_id
    report(f, second, True, 22.0)
    p.observe(KEY, 23.0, 1)  # traffic (the in-process router's count): both wake at once
    assert {a.replica_id for a in p.decide(cat, f.rec.book, {KEY: 2}, 23.0)} == {first.replica_id,
                                                                                   second.replica_id}


def test_a_request_that_brought_no_report_is_asked_again_after_resend_after():
    cat = sleepy(after=5)
    f = ready_fleet(cat, 1)
    p = SleepPlanner(resend_after=10)
    p.observe(KEY, 0.0, 0)
    assert p.decide(cat, f.rec.book, {KEY: 1}, 5.0) == []  # Ready at 0.5: it gets the whole idle time too
    (act,) = p.decide(cat, f.rec.book, {KEY: 1}, 5.5)
    assert p.decide(cat, f.rec.book, {KEY: 1}, 15.0) == []
    assert p.decide(cat, f.rec.book, {KEY: 1}, 15.5) == [act]  # the stream that carried it dropped


def test_a_replica_whose_ready_report_the_reconciler_has_not_noted_yet_is_not_put_to_sleep():
    """The pass hears a replica's Ready report, then decides sleep, then reconciles (which notes ready_since):
    a replica Ready since the last pass had no ready_since and was slept at once, though the deployment had
    been idle only while the replica loaded, perhaps for the very request it came up for."""
    cat = sleepy(after=5)
    f = ready_fleet(cat, 1)
    (r,) = f.rec.book.replicas.values()
    r.ready_since = None  # its report heard this pass, before the reconcile that notes it
    p = SleepPlanner()
    p.observe(KEY, 0.0, 0)
    assert p.decide(cat, f.rec.book, {KEY: 1}, 10.0) == []
    r.ready_since = 10.0
    assert p.decide(cat, f.rec.book, {KEY: 1}, 14.0) == [] and len(p.decide(cat, f.rec.book, {KEY: 1}, 15.0)) == 1


def test_a_replica_that_stops_being_ready_is_no_longer_asleep_and_deployments_without_sleep_are_left_alone():
    cat = sleepy(after=5)
    f = ready_fleet(cat, 1)
    p = SleepPlanner()
    p.observe(KEY, 0.0, 0)
    (act,) = p.decide(cat, f.rec.book, {KEY: 1}, 6.0)
    report(f, act, True, 6.0)
    (r,) = f.rec.book.replicas.values()
    observe_status(f.rec.book, act.node_id, {"type": "shard_status", "shard_id": act.shard_id, "state": "failed"},
                   7.0)
    assert r.shards[0].sleeping is False
    plain = catalog(replicas=1)
    assert p.decide(plain, f.rec.book, {}, 100.0) == [] and p.sleeping_keys(plain, "tiny") == []
    assert p.busy_at == {}  # forgotten with its deployment


def test_a_replica_whose_agent_has_not_said_whether_it_sleeps_is_neither_slept_nor_woken():
    """After a restart of the agent or the control plane nobody knows whether the engine sleeps until the
    agent has asked it: a sleep sent then could land on a sleeping engine, a wake on a guess."""
    cat = sleepy(after=30, level=1)
    f = ready_fleet(cat, 1, say_sleeping=False)
    p = SleepPlanner()
    p.observe(KEY, 1.0, 0)
    assert p.decide(cat, f.rec.book, {KEY: 1}, 100.0) == []
    p.wake_requested(p.sleeping_keys(cat, "tiny"), 101.0)
    assert p.decide(cat, f.rec.book, {KEY: 1}, 101.0) == []
    (r,) = f.rec.book.replicas.values()
    s = r.shards[0]
    observe_status(f.rec.book, s.node_id, {"type": "shard_status", "shard_id": s.shard_id, "state": "ready",
                                           "sleeping": True}, 102.0)  # the agent asked the engine
    (wake,) = p.decide(cat, f.rec.book, {KEY: 1}, 102.0)
    assert wake == Wake(s.node_id, s.shard_id, r.replica_id)
