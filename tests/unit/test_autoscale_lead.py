"""A deployment's lead time: placement to Ready of the replicas this control plane placed, median of the last."""

from __future__ import annotations

from llmgw.controlplane.autoscale_lead import LeadTimes
from llmgw.controlplane.replicas import Replica, ReplicaBook


def book(*replicas: tuple[str, str, float, float | None, bool]) -> ReplicaBook:
    b = ReplicaBook()
    for rid, key, created, ready, adopted in replicas:
        model, profile = key.split("/")
        b.replicas[rid] = Replica(rid, model, profile, 1, 0, {}, created_at=created, adopted=adopted,
                                  ready_since=ready)
    return b


def test_the_lead_is_the_median_of_the_starts_measured():
    leads = LeadTimes(keep=3)
    assert leads.lead("m/p") is None
    b = book(("r1", "m/p", 0.0, 90.0, False), ("r2", "m/p", 10.0, 40.0, False), ("r3", "m/p", 0.0, None, False),
             ("r4", "m/p", 0.0, 500.0, True), ("r5", "o/p", 0.0, 7.0, False))
    leads.note(b)
    assert leads.lead("m/p") == 60.0  # 90 and 30; the one not Ready and the adopted one say nothing
    assert leads.lead("o/p") == 7.0
    b.replicas["r3"].ready_since = 20.0  # Ready now: measured once
    leads.note(b)
    leads.note(b)
    assert leads.lead("m/p") == 30.0  # 90, 30, 20


def test_only_the_last_starts_count_and_gone_deployments_are_forgotten():
    leads = LeadTimes(keep=2)
    for i, took in enumerate((100.0, 10.0, 12.0)):
        leads.note(book((f"r{i}", "m/p", 0.0, took, False)))
    assert leads.lead("m/p") == 11.0  # the first start has aged out
    leads.note(book(("x", "m/p", 0.0, 5.0, False)), keys={"o/p"})
    assert leads.lead("m/p") == 11.0  # not one of the deployments asked about
    leads.forget({"o/p"})
    assert leads.lead("m/p") is None
