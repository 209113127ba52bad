"""Lending a sleeping deployment's GPUs (``autoscale.sleep.lend``): only where placement then fits the borrower."""

from __future__ import annotations

import dataclasses

from reconciler_fleet import Fleet, make_ready

from llmgw.catalog import Autoscale, Catalog, Sleep
from llmgw.controlplane.autoscale_lend import Lending
from llmgw.controlplane.autoscale_zero import from_zero_keys, from_zero_names

GIB = 1 << 30


def two_models(lend: bool = True, lender_priority: int = 0, borrower_priority: int = 0) -> Catalog:
    return Catalog.from_config({
        "models": [{"name": "tiny", "source": "/models/tiny", "size_bytes": GIB},
                   {"name": "other", "source": "/models/other", "size_bytes": GIB}],
        "profiles": [{"name": "sim", "engine": "vllm", "start_timeout": 60}],
        "deployments": [
            {"model": "tiny", "profile": "sim", "replicas": 1,
             "autoscale": {"min": 1, "max": 1, "priority": lender_priority, "sleep": {"after": 60, "lend": lend}}},
            {"model": "other", "profile": "sim", "replicas": 1,
             "autoscale": {"min": 1, "max": 1, "priority": borrower_priority}}],
    })


def lender_only(cat: Catalog, n: int) -> dict[str, int]:
    """The tick's counts: the lender at ``n``, the borrower at 1."""
    return {"tiny/sim": n, "other/sim": 1}


def fleet_with_a_sleeping_lender(cat: Catalog) -> tuple[Fleet, dict]:
    """One node, one GPU: the lender placed, Ready and asleep; the borrower unplaced for want of the GPU."""
    f = Fleet("a", gpus=1)
    only_lender = dataclasses.replace(cat, deployments=cat.deployments[:1])
    f.step(only_lender, 0.0, replica_counts={"tiny/sim": 1})
    make_ready(f, 1.0)
    (r,) = f.rec.book.live()
    r.shards[0].sleeping = True
    plan = f.step(cat, 2.0, replica_counts=lender_only(cat, 1))
    assert set(plan.unplaced) == {("other/sim", 0)}, plan.unplaced
    return f, plan.unplaced


def test_a_sleeping_lender_lends_when_that_places_the_borrower_and_is_back_on_demand():
    cat = two_models()
    f, unplaced = fleet_with_a_sleeping_lender(cat)
    lending = Lending()
    loan = lending.lend(cat, f.rec.book, f.nodes, unplaced, 3.0, 0.2)
    assert loan is not None and (loan.lender, loan.borrower) == ("tiny/sim", "other/sim")
    counts = lending.counts(lender_only(cat, 1))
    assert counts == {"tiny/sim": 0, "other/sim": 1}
    assert lending.lend(cat, f.rec.book, f.nodes, unplaced, 4.0, 0.2) is None  # one loan per lender
    plan = f.step(cat, 4.0, replica_counts=counts)  # the lender drains (asleep: nothing in flight)
    assert not [r for r in f.rec.book.live() if r.key == "tiny/sim"], plan.events
    # named as a model that can be at zero: the routers hold its requests, and its wake ends the loan
    assert from_zero_names(cat) == ("tiny",) and from_zero_keys(cat, "tiny") == ["tiny/sim"]
    assert lending.end("tiny/sim") == loan and lending.counts(lender_only(cat, 1))["tiny/sim"] == 1


def test_no_loan_where_it_would_not_place_the_borrower_or_the_lender_is_awake_or_outranks_it():
    cat = two_models()
    f, unplaced = fleet_with_a_sleeping_lender(cat)
    lending = Lending()
    (r,) = [r for r in f.rec.book.live() if r.key == "tiny/sim"]
    r.shards[0].sleeping = False  # awake: it serves, or is about to
    assert lending.lend(cat, f.rec.book, f.nodes, unplaced, 3.0, 0.2) is None
    r.shards[0].sleeping = True
    assert lending.lend(two_models(lend=False), f.rec.book, f.nodes, unplaced, 3.0, 0.2) is None  # held for it
    assert lending.lend(two_models(lender_priority=5), f.rec.book, f.nodes, unplaced, 3.0, 0.2) is None
    # a borrower that needs two GPUs on one node would not fit on the lender's one: no loan
    big = Catalog.from_config({**_config(cat), "profiles": [{"name": "sim", "engine": "vllm", "start_timeout": 60},
                                                            {"name": "tp2", "engine": "vllm", "tensor_parallel_size": 2}]})
    big = dataclasses.replace(big, deployments=(cat.deployments[0], dataclasses.replace(
        cat.deployments[1], profile="tp2")))
    assert lending.lend(big, f.rec.book, f.nodes, {("other/tp2", 0): "no GPU"}, 3.0, 0.2) is None
    assert lending.loans == {}


def _config(cat: Catalog) -> dict:
    return {"models": [{"name": m.name, "source": m.source, "size_bytes": GIB} for m in cat.models.values()],
            "deployments": []}


def test_a_lend_setting_removed_by_a_reload_ends_the_loan():
    cat = two_models()
    f, unplaced = fleet_with_a_sleeping_lender(cat)
    lending = Lending()
    assert lending.lend(cat, f.rec.book, f.nodes, unplaced, 3.0, 0.2) is not None
    lending.forget(two_models(lend=False))
    assert lending.loans == {}


def test_lend_is_read_from_the_catalog_and_defaults_to_held():
    assert two_models().deployments[0].autoscale.sleep == Sleep(after=60, level=1, lend=True)
    assert Autoscale(max=1, sleep=Sleep(after=60)).sleep.lend is False


def test_the_same_waiting_slots_beside_the_same_lenders_are_looked_at_again_only_after_a_while():
    """A slot that waits for good must not cost a walk of the fleet every pass: when a look made no loan,
    the same slots beside the same sleeping lenders are looked at again after ``retry_after``."""
    cat = two_models()
    f, unplaced = fleet_with_a_sleeping_lender(cat)
    lending = Lending(retry_after=10)
    r = [r for r in f.rec.book.live() if r.key == "tiny/sim"][0]
    shard = r.shards[0]
    gpus, shard.gpu_indices = shard.gpu_indices, ()  # its GPU shown free: the borrower waits for something else
    assert lending.lend(cat, f.rec.book, f.nodes, unplaced, 3.0, 0.2) is None
    shard.gpu_indices = gpus
    assert lending.lend(cat, f.rec.book, f.nodes, unplaced, 5.0, 0.2) is None  # not looked at again yet
    assert lending.lend(cat, f.rec.book, f.nodes, unplaced, 13.0, 0.2) is not None
