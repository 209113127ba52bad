"""The report endpoint's pure parts: the budget that grows with a router's workers, and numbers refused."""

from __future__ import annotations

import pytest

from llmgw.config import schema_errors
from llmgw.controlplane.ejections_api import BURST, REFILL
from llmgw.controlplane.routerposts import MAX_WORKERS, NumberRefused, RouterBudget, parse_report
from llmgw.router.ejectreport import REPORT_INTERVAL


def run_workers(budget: RouterBudget, workers: int, seconds: float, t0: float = 0.0) -> tuple[int, int]:
    """``workers`` each reporting every REPORT_INTERVAL, staggered: (accepted, refused)."""
    ok = refused = 0
    events = sorted((t0 + k * REPORT_INTERVAL + w * REPORT_INTERVAL / workers, f"w{w}")
                    for w in range(workers) for k in range(int(seconds / REPORT_INTERVAL)))
    for t, inst in events:
        if budget.take(t):
            budget.seen(inst, t)
            ok += 1
        else:
            refused += 1
    return ok, refused


def test_a_router_with_16_workers_gets_every_report_through():
    budget = RouterBudget.new(0.0, BURST, REFILL)
    ok, refused = run_workers(budget, 16, 18.0)
    assert (ok, refused) == (144, 0)  # a budget per router name alone refused 85 of these 144


def test_the_same_16_workers_arriving_at_once_lose_nothing_after_the_first_round():
    budget = RouterBudget.new(0.0, BURST, REFILL)
    ok = refused = 0
    for k in range(9):
        for w in range(16):
            if budget.take(k * REPORT_INTERVAL):
                budget.seen(f"w{w}", k * REPORT_INTERVAL)
                ok += 1
            else:
                refused += 1
    assert refused == 0 and ok == 144


def test_a_runaway_worker_is_still_held_to_its_rate():
    budget = RouterBudget.new(0.0, BURST, REFILL)
    budget.seen("w0", 0.0)
    got = sum(budget.take(0.0) for _ in range(100))
    assert got == BURST
    assert sum(budget.take(1.0) for _ in range(100)) == REFILL


def test_invented_instances_widen_the_budget_only_up_to_the_cap_and_are_forgotten():
    budget = RouterBudget.new(0.0, BURST, REFILL)
    for i in range(10 * MAX_WORKERS):
        budget.seen(f"x{i}", 0.0)
    assert budget.size(0.0) == MAX_WORKERS
    assert budget.size(61.0) == 1  # none heard from for a minute


@pytest.mark.parametrize("body,what", [
    (b'{"ejections": [{"ejected_for_s": NaN}]}', "NaN is not a number this API accepts"),
    (b'{"ejections": [{"ejected_for_s": Infinity}]}', "Infinity is not a number"),
    (b'{"ejections": [{"ejected_for_s": -Infinity}]}', "-Infinity is not a number"),
    (b'{"ejections": [{"ejected_for_s": 1e400}]}', "1e400 is not a finite number"),
    (b'{"ejections": [{"consecutive_failures": ' + b"9" * 400 + b"}]}", "a number of 400 characters"),
])
def test_numbers_json_schema_cannot_refuse_are_refused_by_the_parse(body, what):
    with pytest.raises(NumberRefused, match=what):
        parse_report(body)


def test_plausible_numbers_parse_and_absurd_counts_and_negative_durations_fail_the_schema():
    doc = parse_report(b'{"ejections": [{"endpoint_id": "e", "replica_id": "r", "reason": "x", '
                       b'"ejected_for_s": 12.5, "consecutive_failures": 3, "ejections": 1}]}')
    assert schema_errors(doc, "router-ejections") == []
    e = doc["ejections"][0]
    doc["ejections"][0] = {**e, "ejected_for_s": -0.5, "consecutive_failures": 10**12, "ejections": 10**10}
    pointers = {x.pointer for x in schema_errors(doc, "router-ejections")}
    assert pointers == {"/ejections/0/ejected_for_s", "/ejections/0/consecutive_failures", "/ejections/0/ejections"}
