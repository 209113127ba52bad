"""The autoscaler's count through the reconciler: placed like a declared count, drained on the way down."""

from __future__ import annotations

import dataclasses

from reconciler_fleet import Fleet, catalog, make_ready, starts

from llmgw.catalog import Autoscale, Catalog
from llmgw.controlplane.autoscaler import Autoscaler, totals_by_deployment
from llmgw.controlplane.reconcile.plan import Drain, Stop
from llmgw.controlplane.reconcile.replicacount import deployments


def autoscaled(start: int = 1, **kw) -> Catalog:
    cat = catalog(replicas=start)
    (dep,) = cat.deployments
    return dataclasses.replace(cat, deployments=(dataclasses.replace(dep, autoscale=Autoscale(**{"max": 4, **kw})),))


def test_only_autoscaled_deployments_take_the_decided_count():
    cat = autoscaled()
    plain = catalog(replicas=1)
    assert deployments(cat, {"tiny/sim": 3})[0].replicas == 3
    assert deployments(plain, {"tiny/sim": 3})[0].replicas == 1


def test_a_higher_count_is_placed_and_a_lower_one_drains_before_it_stops():
    f = Fleet("a", "b", gpus=1)
    cat = autoscaled()
    f.step(cat, 0.0, replica_counts={"tiny/sim": 1})
    make_ready(f, 1.0)
    f.step(cat, 1.0, replica_counts={"tiny/sim": 1})
    plan = f.step(cat, 2.0, replica_counts={"tiny/sim": 2})
    assert len(starts(plan)) == 1
    make_ready(f, 3.0)
    f.step(cat, 3.0, replica_counts={"tiny/sim": 2})
    assert len(list(f.rec.book.live())) == 2
    plan = f.step(cat, 4.0, replica_counts={"tiny/sim": 1})
    assert [type(a) for a in plan.actions] == [Drain]  # drained, not stopped
    assert not [a for a in plan.actions if isinstance(a, Stop)]
    assert any("scaled down" in e for e in plan.events)
    assert len(list(f.rec.book.live())) == 1


def test_the_autoscaler_counts_in_flight_requests_per_deployment_and_holds_adopted_replicas_in_grace():
    f = Fleet("a", "b", gpus=1)
    cat = autoscaled(start=1, target=2, stable_window=10, panic_window=1)
    f.step(cat, 0.0, replica_counts={"tiny/sim": 2})
    make_ready(f, 1.0)
    book = f.rec.book
    scaler = Autoscaler()
    # in grace: what runs (2) is kept though the declared start is 1
    assert scaler.counts(cat, book, 1.0, None, in_grace=True) == {"tiny/sim": 2}
    rids = [r.replica_id for r in book.live()]
    totals = totals_by_deployment({rids[0]: 5, rids[1]: 3, "unknown": 9}, book)
    assert totals == {"tiny/sim": 8.0}
    assert scaler.counts(cat, book, 2.0, totals) == {"tiny/sim": 4}  # 8 in flight / 2 per replica
    assert scaler.decision("tiny/sim").reason == "panic"


def test_ctl_explain_prints_the_autoscale_line_first():
    from llmgw.ctl.fleet import format_explain

    doc = {"model": "tiny", "refused": [], "replicas": [{"replica": "tiny/sim#0", "text": "running"}],
           "autoscale": [{"deployment": "tiny/sim", "text": "autoscale 1..2: 2 replica(s) (panic)"}]}
    assert format_explain(doc)[:2] == ["tiny/sim: autoscale 1..2: 2 replica(s) (panic)", "tiny/sim#0:"]


def test_a_scale_up_that_does_not_fit_says_why():
    f = Fleet("a", "b", gpus=1)
    plan = f.step(autoscaled(), 0.0, replica_counts={"tiny/sim": 3})
    assert len(starts(plan)) == 2
    assert set(plan.unplaced) == {("tiny/sim", 2)}
    assert "GPU" in plan.unplaced[("tiny/sim", 2)], plan.unplaced


def test_a_count_of_zero_drains_the_last_replica_and_one_places_it_again():
    f = Fleet("a", "b", gpus=1)
    cat = autoscaled(min=0)
    f.step(cat, 0.0, replica_counts={"tiny/sim": 1})
    make_ready(f, 1.0)
    f.step(cat, 1.0, replica_counts={"tiny/sim": 1})
    plan = f.step(cat, 2.0, replica_counts={"tiny/sim": 0})
    assert [type(a) for a in plan.actions] == [Drain]
    assert not list(f.rec.book.live())
    plan = f.step(cat, 3.0, replica_counts={"tiny/sim": 1})
    assert len(starts(plan)) == 1


def test_requests_held_for_a_deployment_at_zero_are_its_demand_while_the_routers_keep_saying_so():
    """At zero no replica carries the routers' count: a wake's held count is the signal, for a few
    seconds after each (the router asks every second while it holds)."""
    f = Fleet("a", "b", gpus=1)
    cat = autoscaled(start=0, min=0, target=2, stable_window=10, panic_window=1)
    scaler = Autoscaler()
    book = f.rec.book
    assert scaler.counts(cat, book, 0.0, {}) == {"tiny/sim": 0}
    scaler.note_held("tiny/sim", "r1", 3, 1.0)
    scaler.note_held("tiny/sim", "r2", 2, 1.0)
    assert scaler.counts(cat, book, 1.0, {}) == {"tiny/sim": 1}  # the first replica, on the first word
    assert scaler.decision("tiny/sim").reason == "from-zero"
    scaler.note_held("tiny/sim", "r1", 3, 2.0)  # asked again a second later: 5 held / 2 per replica
    scaler.note_held("tiny/sim", "r2", 2, 2.0)
    assert scaler.counts(cat, book, 2.0, {}) == {"tiny/sim": 3}
    assert scaler.decision("tiny/sim").panic == 5.0
    scaler.counts(cat, book, 5.0, {})  # no word for 3 s: nothing held any more
    scaler.counts(cat, book, 7.0, {})
    assert scaler.decision("tiny/sim").panic == 0.0
    assert scaler.held == {}
