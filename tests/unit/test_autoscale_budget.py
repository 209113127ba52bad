"""The fleet GPU budget: priorities win, equals share by demand, never below min, damped rises; catalog and wiring."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from reconciler_fleet import Fleet, catalog, make_ready, starts
from autoscale_docs import SERVER, errors

from llmgw.catalog import Autoscale, Catalog
from llmgw.controlplane.autoscale_budget import (
    FULL, OVER, POOL, PRIORITY, REVERSAL, SHARE, Budget, Claim, arbitrate,
)
from llmgw.controlplane.autoscaler import Autoscaler
from llmgw.controlplane.reconcile.plan import Drain, Stop
from llmgw.settings import parse_server_settings


def granted(grants) -> dict[str, int]:
    return {k: g.granted for k, g in grants.items()}


def test_everything_fits_everyone_gets_its_desired_count():
    out = arbitrate([Claim("a", 3, 1, priority=5), Claim("b", 2, 1)], pool=5)
    assert granted(out) == {"a": 3, "b": 2}
    assert {g.reason for g in out.values()} == {FULL}


def test_the_higher_priority_wins_and_the_lower_is_held_at_what_is_left_never_below_min():
    out = arbitrate([Claim("hi", 3, 1, priority=10), Claim("lo", 3, 1)], pool=4)
    assert granted(out) == {"hi": 3, "lo": 1}
    assert out["lo"].reason == PRIORITY
    assert "priority 10 deployment hi holds the GPUs" in out["lo"].explain()
    assert "granted 1 of 3" in out["lo"].explain()
    # a winner that wants the whole pool still leaves the loser its min
    out = arbitrate([Claim("hi", 9, 1, priority=10), Claim("lo", 3, 2)], pool=6)
    assert granted(out) == {"hi": 4, "lo": 2}
    assert out["hi"].reason == POOL and "the budget holds no more" in out["hi"].explain()


def test_equal_priorities_share_what_is_left_in_proportion_to_demand_above_min():
    # 8 GPUs, mins take 2; a asks 6 more, b asks 2 more: 6 left split 4.5 / 1.5 -> 4 + 1, the last to a
    out = arbitrate([Claim("a", 7, 1), Claim("b", 3, 1)], pool=8)
    assert granted(out) == {"a": 6, "b": 2}
    assert out["a"].reason == SHARE and out["a"].peers == ("b",)
    assert "in proportion to demand" in out["b"].explain()
    assert sum(granted(out).values()) == 8


def test_gpus_per_replica_count_and_what_a_tier_cannot_use_goes_down():
    # hi needs 2 GPUs a replica: 3 left after mins fit one more of hi, the last GPU goes to lo
    out = arbitrate([Claim("hi", 4, 1, priority=1, gpus=2), Claim("lo", 3, 1)], pool=6)
    assert granted(out) == {"hi": 2, "lo": 2}
    assert out["lo"].reason == PRIORITY and out["lo"].winners == ("priority 1 deployment hi",)


def test_mins_beyond_the_pool_stay_at_min():
    out = arbitrate([Claim("a", 3, 2), Claim("b", 2, 2)], pool=3)
    assert granted(out) == {"a": 2, "b": 2}
    assert out["a"].reason == OVER


def test_a_grant_falls_at_once_but_rises_again_at_most_once_per_cooldown():
    b = Budget()
    lo = lambda d: Claim("lo", d, 1, cooldown=100)  # noqa: E731
    hi = lambda d: Claim("hi", d, 1, priority=9, cooldown=100)  # noqa: E731
    assert granted(b.grant([hi(1), lo(3)], 4, 0.0)) == {"hi": 1, "lo": 3}
    assert granted(b.grant([hi(3), lo(3)], 4, 1.0)) == {"hi": 3, "lo": 1}  # falls at once
    assert granted(b.grant([hi(1), lo(3)], 4, 2.0)) == {"hi": 1, "lo": 3}  # first reversal: allowed
    assert granted(b.grant([hi(3), lo(3)], 4, 3.0)) == {"hi": 3, "lo": 1}  # falling: always allowed
    out = b.grant([hi(1), lo(3)], 4, 4.0)
    assert out["lo"].granted == 1 and out["lo"].reason == REVERSAL  # a third reversal within 100 s: held
    assert granted(b.grant([hi(1), lo(3)], 4, 104.0)) == {"hi": 1, "lo": 3}  # a cooldown later it rises


def test_the_damping_never_holds_a_grant_below_a_min_a_reload_raised():
    b = Budget()
    hi = Claim("hi", 3, 1, priority=9, cooldown=100)
    b.grant([Claim("hi", 1, 1, priority=9), Claim("lo", 3, 1, cooldown=100)], 4, 0.0)
    b.grant([hi, Claim("lo", 3, 1, cooldown=100)], 4, 1.0)  # lo cut to 1
    b.grant([Claim("hi", 1, 1, priority=9), Claim("lo", 3, 1, cooldown=100)], 4, 2.0)  # back to 3: a reversal
    b.grant([hi, Claim("lo", 3, 1, cooldown=100)], 4, 3.0)  # cut to 1 again
    out = b.grant([Claim("hi", 2, 1, priority=9), Claim("lo", 3, 2, cooldown=100)], 4, 4.0)  # min raised to 2
    assert out["lo"].granted == 2


BUDGET = {"autoscale_budget": {"gpus": 3}}


def test_the_catalog_takes_priority_and_the_budget_with_defaults():
    doc = {**copy.deepcopy(SERVER), **BUDGET}
    doc["deployments"][0]["autoscale"]["priority"] = 7
    cat = parse_server_settings(doc).catalog
    assert cat.autoscale_budget == 3
    assert cat.deployments[0].autoscale.priority == 7
    assert parse_server_settings(copy.deepcopy(SERVER)).catalog.autoscale_budget is None
    assert Autoscale(max=2).priority == 0


@pytest.mark.parametrize("patch, pointer, words", [
    ({"autoscale_budget": {"gpus": 1}, "min": 2}, "/autoscale_budget/gpus", "mins, which need 2"),
    ({"autoscale_budget": {"gpus": -1}}, "/autoscale_budget/gpus", ""),
    ({"autoscale_budget": {"cpus": 2}}, "/autoscale_budget", ""),
    ({"priority": "high"}, "/deployments/0/autoscale/priority", ""),
])
def test_bad_budgets_and_priorities_are_refused_at_their_key(patch, pointer, words):
    doc = copy.deepcopy(SERVER)
    patch = dict(patch)
    if "autoscale_budget" in patch:
        doc["autoscale_budget"] = patch.pop("autoscale_budget")
    doc["deployments"][0]["autoscale"].update(patch)
    errs = errors(doc)
    assert pointer in errs, errs
    assert words in errs[pointer]


def two_models(pool: int) -> Catalog:
    cat = catalog(replicas=1, extra=[{"model": "other", "profile": "sim", "replicas": 3}])
    hi, lo = cat.deployments
    return dataclasses.replace(cat, autoscale_budget=pool, deployments=(
        dataclasses.replace(hi, autoscale=Autoscale(max=4, min=1, target=1, priority=10, stable_window=10,
                                                    panic_window=1, scale_down_cooldown=5)),
        dataclasses.replace(lo, autoscale=Autoscale(max=4, min=1, target=1, stable_window=10, panic_window=1,
                                                    scale_down_cooldown=5))))


def test_the_autoscaler_grants_by_priority_and_the_reconciler_drains_the_loser_before_stopping_it():
    f = Fleet("a", "b", gpus=2)
    cat = two_models(pool=4)
    scaler = Autoscaler()
    counts = scaler.counts(cat, f.rec.book, 0.0, {"tiny/sim": 0, "other/sim": 3})
    assert counts == {"tiny/sim": 1, "other/sim": 3}  # the low one may use what the high one leaves
    f.step(cat, 0.0, replica_counts=counts)
    make_ready(f, 1.0)
    f.step(cat, 1.0, replica_counts=counts)
    assert len(list(f.rec.book.live())) == 4
    scaler.counts(cat, f.rec.book, 2.0, {"tiny/sim": 3, "other/sim": 3})
    counts = scaler.counts(cat, f.rec.book, 3.0, {"tiny/sim": 3, "other/sim": 3})  # a second of it: a burst
    assert scaler.decision("tiny/sim").desired == 3 and scaler.decision("other/sim").desired == 3
    assert counts == {"tiny/sim": 3, "other/sim": 1}
    g = scaler.grant("other/sim")
    assert g.reason == PRIORITY and "priority 10 deployment tiny/sim holds the GPUs" in g.explain()
    plan = f.step(cat, 3.0, replica_counts=counts)
    assert [type(a) for a in plan.actions if isinstance(a, (Drain, Stop))] == [Drain, Drain]
    assert not starts(plan)  # the winner's replicas wait for the GPUs: make before break


def test_no_budget_no_arbitration_and_none_during_the_grace():
    f = Fleet("a", gpus=2)
    cat = dataclasses.replace(two_models(pool=2), autoscale_budget=None)
    scaler = Autoscaler()
    assert scaler.counts(cat, f.rec.book, 0.0, {"tiny/sim": 3, "other/sim": 3}) == {"tiny/sim": 3, "other/sim": 3}
    assert scaler.grant("other/sim") is None
    cat = two_models(pool=2)
    assert Autoscaler().counts(cat, f.rec.book, 0.0, None, in_grace=True) == {"tiny/sim": 1, "other/sim": 3}
