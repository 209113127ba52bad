"""Standalone routers' load: fresh reports summed per replica, a silent worker holding the signal until forgotten."""

from __future__ import annotations

from llmgw.config import schema_errors
from llmgw.controlplane.routerload import FRESH, MAX_WORKERS, REMEMBER, RouterLoad
from llmgw.controlplane.routerload_api import BURST, REFILL
from llmgw.controlplane.routerposts import RouterBudget
from llmgw.router.loadreport import REPORT_INTERVAL


def test_fresh_reports_are_summed_per_replica_over_routers_and_workers():
    load = RouterLoad()
    load.report("r1", "w1", {"a": 2, "b": 1}, 0.0)
    load.report("r1", "w2", {"a": 3}, 0.5)
    load.report("r2", "w1", {"b": 4}, 1.0)
    load.report("r1", "w1", {"a": 1}, 1.0)  # a worker's newer report replaces its older one
    assert load.totals(1.5) == {"a": 4, "b": 4}
    assert load.workers(1.5) == 3 and load.silent(1.5) == []


def test_a_silent_worker_holds_the_signal_until_it_is_forgotten():
    load = RouterLoad()
    load.report("r1", "w1", {"a": 5}, 0.0)
    load.report("r2", "w1", {}, 0.0)  # idle, but alive: an empty report counts as one
    for t in range(1, 10):
        load.report("r2", "w1", {}, float(t))
    assert load.silent(9.0) == ["r1"]  # r1 stopped after t=0: its requests may still be in flight
    assert load.totals(9.0) == {}  # what it said is no longer counted as now
    # a minute on: r1 is forgotten (a router that was stopped holds nothing), r2 silent since t=9
    assert load.silent(REMEMBER + 0.5) == ["r2"]
    load.report("r2", "w1", {}, REMEMBER + 1.0)
    assert load.silent(REMEMBER + 1.0) == [] and load.silent(REMEMBER + 1.0 + FRESH) == []


def test_a_worker_reporting_every_second_is_never_refused():
    budget = RouterBudget.new(0.0, BURST, REFILL)
    t, refused = 0.0, 0
    for _ in range(120):
        if budget.take(t):
            budget.seen("w", t)
        else:
            refused += 1
        t += REPORT_INTERVAL
    assert refused == 0
    assert sum(budget.take(200.0) for _ in range(100)) == BURST  # a runaway worker is held to its rate


def test_the_report_schema_refuses_what_no_router_sends():
    ok = {"instance": "w1", "outstanding": {"tiny.sim.0-abc": 3}}
    assert schema_errors(ok, "router-load") == []
    assert schema_errors({"instance": "w1", "outstanding": {}}, "router-load") == []
    bad = {"instance": "", "outstanding": {"r": 0, "s": -1, "t": 10**7}, "extra": 1}
    pointers = {e.pointer for e in schema_errors(bad, "router-load")}
    assert {"/instance", "/outstanding/r", "/outstanding/s", "/outstanding/t"} <= pointers, pointers


def test_a_router_inventing_workers_keeps_at_most_its_cap_and_its_newest():
    load = RouterLoad()
    load.report("other", "w", {"x": 1}, 0.0)
    for i in range(10 * MAX_WORKERS):
        load.report("r1", f"w{i}", {"a": 1}, 1.0 + i * 1e-3)
    assert load.workers(2.0) == MAX_WORKERS + 1  # the other router's worker is untouched
    assert load.totals(2.0) == {"a": MAX_WORKERS, "x": 1}
