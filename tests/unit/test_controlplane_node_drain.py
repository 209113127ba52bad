"""Cordon and node drain in the reconciler: nothing new on a cordoned node; a drain moves
replicas elsewhere one at a time, each replacement Ready before the old one is drained."""

from __future__ import annotations

from llmgw.controlplane.reconciler import Drain, Stop, endpoints
from llmgw.controlplane.replicas import ReplicaState

from reconciler_fleet import Fleet, catalog, make_ready, no_double_claims, starts


def placed_and_ready(f: Fleet, cat) -> list:
    """One pass that places, every shard Ready, and the pass that sees it: the starts of the first."""
    first = starts(f.step(cat, 0.0))
    make_ready(f, 1.0)
    f.step(cat, 1.0)
    return first


def serving(f: Fleet) -> dict[str, str]:
    """Replica id -> node of every live replica."""
    return {r.replica_id: ",".join(sorted(r.nodes())) for r in f.rec.book.live()}


def test_nothing_new_is_placed_on_a_cordoned_node():
    f = Fleet("a", "b", gpus=1)
    f.set("a", cordon="cordoned")
    plan = f.step(catalog(replicas=2), 0.0)
    assert [s.node_id for s in starts(plan)] == ["b"]
    assert "1 not schedulable" in str(plan.unplaced)
    f.set("a", cordon=None)
    assert [s.node_id for s in starts(f.step(catalog(replicas=2), 1.0))] == ["a"]


def test_cordon_keeps_what_runs():
    f = Fleet("a", "b", gpus=1)
    cat = catalog(replicas=1)
    (s,) = placed_and_ready(f, cat)
    f.set(s.node_id, cordon="cordoned")
    plan = f.step(cat, 2.0)
    assert plan.actions == [] and serving(f) == {s.spec["replica_id"]: s.node_id}


def test_drain_is_make_before_break_one_replica_at_a_time():
    f = Fleet("a", "b", gpus=2)
    cat = catalog(replicas=2)
    f.set("b", cordon="cordoned")  # both replicas land on a
    first = placed_and_ready(f, cat)
    assert [s.node_id for s in first] == ["a", "a"]
    f.set("b", cordon=None)
    f.set("a", cordon="draining")
    old = sorted(s.spec["replica_id"] for s in first)

    plan = f.step(cat, 2.0)
    (twin,) = starts(plan)  # one move at a time
    assert twin.node_id == "b" and not [a for a in plan.actions if isinstance(a, (Stop, Drain))]
    twin_id = twin.spec["replica_id"]
    assert f.rec.book.replicas[twin_id].surge_for == old[0]
    assert f.rec.book.replicas[twin_id].slot is None
    # while the twin starts, the old one serves and nothing else moves
    assert starts(f.step(cat, 3.0)) == []
    assert {e["replica_id"] for e in endpoints(f.rec.book, f.nodes)} == set(old)

    make_ready(f, 4.0)
    plan = f.step(cat, 4.0)
    # the twin is Ready: the old one is drained (still in the router, marked draining) and the next move starts
    assert [a.shard_id for a in plan.actions if isinstance(a, Drain)] == [f"{old[0]}/r0"]
    assert f.rec.book.replicas[old[0]].state is ReplicaState.DRAINING
    assert f.rec.book.replicas[twin_id].surge_for is None and f.rec.book.replicas[twin_id].slot is not None
    (twin2,) = starts(plan)
    assert twin2.node_id == "b" and f.rec.book.replicas[twin2.spec["replica_id"]].surge_for == old[1]
    eps = {e["replica_id"]: e["draining"] for e in endpoints(f.rec.book, f.nodes)}
    assert eps == {old[0]: True, old[1]: False, twin_id: False}
    no_double_claims(f)

    f.rec.observe_status("a", {"type": "shard_status", "shard_id": f"{old[0]}/r0", "state": "stopped"}, 5.0)
    make_ready(f, 5.0)
    plan = f.step(cat, 5.0)
    assert [a.shard_id for a in plan.actions if isinstance(a, Drain)] == [f"{old[1]}/r0"]
    f.rec.observe_status("a", {"type": "shard_status", "shard_id": f"{old[1]}/r0", "state": "stopped"}, 6.0)
    plan = f.step(cat, 6.0)
    assert starts(plan) == [] and set(serving(f).values()) == {"b"}
    assert sorted(r.slot for r in f.rec.book.live()) == [0, 1]
    assert not plan.drain_blocked


def test_a_replica_not_serving_is_retired_at_once_and_refilled_elsewhere():
    f = Fleet("a", "b", gpus=1)
    cat = catalog(replicas=1)
    (s,) = starts(f.step(cat, 0.0))  # never Ready
    f.set(s.node_id, cordon="draining")
    plan = f.step(cat, 1.0)
    assert [a.shard_id for a in plan.actions if isinstance(a, Stop)] == [s.spec["shard_id"]]


def test_a_drain_with_nowhere_to_go_waits_and_says_why():
    f = Fleet("a", "b", gpus=1)
    cat = catalog(replicas=2)
    placed_and_ready(f, cat)
    f.set("a", cordon="draining")
    plan = f.step(cat, 2.0)
    assert starts(plan) == [] and [a for a in plan.actions if isinstance(a, (Stop, Drain))] == []
    (why,) = plan.drain_blocked.values()
    assert why.startswith("cannot move ") and "b" in why
    assert len(serving(f)) == 2  # nothing was stopped to make room


def test_a_twin_that_fails_backs_off_and_the_old_replica_keeps_serving():
    f = Fleet("a", "b", gpus=1)
    cat = catalog(replicas=1)
    f.set("b", cordon="cordoned")
    (s,) = placed_and_ready(f, cat)
    f.set("b", cordon=None)
    f.set("a", cordon="draining")
    (twin,) = starts(f.step(cat, 2.0))
    f.rec.observe_status("b", {"type": "shard_status", "shard_id": twin.spec["shard_id"], "state": "failed",
                               "reason": "engine exited"}, 3.0)
    f.step(cat, 3.0)
    assert s.spec["replica_id"] in serving(f) and f.rec.book.replicas[s.spec["replica_id"]].state is ReplicaState.READY
    plan = f.step(cat, 4.0)  # the failed twin is let go after its backoff; no new twin before then
    assert starts(plan) == []


def test_a_replica_judged_sick_is_replaced_make_before_break():
    f = Fleet("a", "b", gpus=2)
    cat = catalog(replicas=2)
    first = placed_and_ready(f, cat)
    sick = first[0].spec["replica_id"]
    assert f.rec.mark_sick(sick, "ejected by 2 routers")
    assert not f.rec.mark_sick(sick, "again")  # news once
    plan = f.step(cat, 2.0)
    (twin,) = starts(plan)
    twin_id = twin.spec["replica_id"]
    assert f.rec.book.replicas[twin_id].surge_for == sick
    assert not [a for a in plan.actions if isinstance(a, (Stop, Drain))]
    assert sick in {e["replica_id"] for e in endpoints(f.rec.book, f.nodes)}  # still serving meanwhile
    make_ready(f, 3.0)
    plan = f.step(cat, 3.0)
    assert [a.shard_id for a in plan.actions if isinstance(a, Drain)] == [f"{sick}/r0"]
    old = f.rec.book.replicas[sick]
    assert old.state is ReplicaState.DRAINING and old.retire_reason.startswith("replaced: ejected by 2 routers")
    assert starts(plan) == []  # the healthy replica stays where it is
    no_double_claims(f)


def test_a_sick_replica_with_no_room_for_a_twin_is_drained_and_its_slot_refilled():
    f = Fleet("a", gpus=2)
    cat = catalog(replicas=2)
    first = placed_and_ready(f, cat)
    sick = first[0].spec["replica_id"]
    f.rec.mark_sick(sick, "ejected by 2 routers")
    plan = f.step(cat, 2.0)
    assert [a.shard_id for a in plan.actions if isinstance(a, Drain)] == [f"{sick}/r0"]
    assert "no room" in f.rec.book.replicas[sick].retire_reason
