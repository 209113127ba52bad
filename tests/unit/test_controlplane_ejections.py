"""The judgement over routers' ejection reports: one router never replaces a replica."""

from __future__ import annotations

from llmgw.config import schema_errors
from llmgw.controlplane.ejections import EjectionBook, judge, routers_needed
from llmgw.router.outlier import Health, OutlierPolicy
from llmgw.router.settings import Outlier
from llmgw.settings import EjectionPolicy

POLICY = EjectionPolicy(min_routers=2, min_share=0.5, sick_after=20.0, report_ttl=10.0)


def entry(rid: str = "r1", for_s: float = 0.0, failures: int = 5) -> dict:
    return {"endpoint_id": rid, "replica_id": rid, "reason": "status_5xx", "ejected_for_s": for_s,
            "consecutive_failures": failures, "ejected_now": True}


def renew(book: EjectionBook, router: str, t0: float, t1: float, rid: str = "r1", step: float = 2.0) -> None:
    """``router`` reports ``rid`` every ``step`` seconds from t0 to t1, its episode starting at t0."""
    t = t0
    while t <= t1:
        book.observe(router, [entry(rid, t - t0)], t)
        t += step


def test_one_router_alone_never_replaces_however_long():
    book = EjectionBook()
    book.watched("router-b", 0.0)
    renew(book, "router-a", 0.0, 600.0)
    v = judge(book, "r1", ready_since=-100.0, now=600.0, policy=POLICY)
    assert not v.sick
    assert v.routers == ("router-a",)
    assert "it takes 2 distinct routers" in v.reason


def test_one_router_alone_is_not_enough_even_when_it_is_the_only_one_watching():
    book = EjectionBook()
    renew(book, "router-a", 0.0, 100.0)
    assert book.watching() == 1
    assert not judge(book, "r1", None, 100.0, POLICY).sick


def test_two_routers_for_long_enough_make_a_quorum():
    book = EjectionBook()
    renew(book, "router-a", 0.0, 30.0)
    renew(book, "router-b", 5.0, 30.0)
    v = judge(book, "r1", ready_since=-50.0, now=24.0, policy=POLICY)
    assert not v.sick and "waiting until 2 of them" in v.reason  # router-b only 19 s so far
    v = judge(book, "r1", ready_since=-50.0, now=26.0, policy=POLICY)
    assert v.sick, v.reason
    assert "router-a" in v.reason and "router-b" in v.reason


def test_the_share_of_watching_routers_raises_the_quorum():
    book = EjectionBook()
    for name in ("a", "b", "c", "d", "e"):
        book.watched(name, 0.0)
    assert routers_needed(POLICY, book.watching()) == 3
    renew(book, "a", 0.0, 30.0)
    renew(book, "b", 0.0, 30.0)
    assert not judge(book, "r1", -100.0, 30.0, POLICY).sick  # two of five routers: a path problem, maybe
    renew(book, "c", 0.0, 30.0)
    assert judge(book, "r1", -100.0, 30.0, POLICY).sick


def test_time_before_the_replica_became_ready_does_not_count():
    book = EjectionBook()
    renew(book, "a", 0.0, 40.0)
    renew(book, "b", 0.0, 40.0)
    # the agent's readiness probe (a real completion) passed at 30: only 10 s of ejection since
    assert not judge(book, "r1", ready_since=30.0, now=40.0, policy=POLICY).sick
    assert judge(book, "r1", ready_since=10.0, now=40.0, policy=POLICY).sick


def test_reports_expire_when_a_router_stops_sending():
    book = EjectionBook()
    renew(book, "a", 0.0, 30.0)
    renew(book, "b", 0.0, 30.0)
    assert judge(book, "r1", -1.0, 30.0, POLICY).sick
    # router b recovered (a success ended its episode) and stopped reporting
    renew(book, "a", 32.0, 50.0)
    book.expire(50.0, POLICY.report_ttl)
    v = judge(book, "r1", -1.0, 50.0, POLICY)
    assert not v.sick and v.routers == ("a",)
    book.expire(200.0, POLICY.report_ttl)
    assert book.for_replica("r1") == []


def test_a_restarted_control_plane_counts_from_the_next_reports_not_from_what_routers_claim():
    # routers re-send every 2 s with how long the episode has lasted; a fresh book does not take their word
    fresh = EjectionBook()
    fresh.observe("a", [entry("r1", 45.0)], 1000.0)
    fresh.observe("b", [entry("r1", 30.0)], 1000.5)
    # the replica was adopted at the restart: when it became Ready is not known
    v = judge(fresh, "r1", ready_since=None, now=1001.0, policy=POLICY)
    assert not v.sick and "waiting until 2 of them" in v.reason, v.reason
    assert [r.view(1001.0)["ejected_for_s"] for r in fresh.for_replica("r1")] == [46.0, 30.5]  # shown
    assert [r.view(1001.0)["counted_for_s"] for r in fresh.for_replica("r1")] == [1.0, 0.5]  # counted
    for t in range(1002, 1022, 2):
        fresh.observe("a", [entry("r1", 45.0 + t - 1000)], float(t))
        fresh.observe("b", [entry("r1", 30.0 + t - 1000)], t + 0.5)
    assert not judge(fresh, "r1", None, 1020.0, POLICY).sick  # b: 19.5 s seen here
    assert judge(fresh, "r1", None, 1020.5, POLICY).sick


def test_two_router_certificates_claiming_an_hour_do_not_replace_a_replica_on_their_first_report():
    book = EjectionBook()
    book.observe("a", [entry("r1", 3600.0)], 500.0)
    book.observe("b", [entry("r1", 3600.0)], 500.0)
    v = judge(book, "r1", ready_since=10.0, now=500.0, policy=POLICY)
    assert not v.sick and "waiting until 2 of them have ejected it for 20s" in v.reason
    renew(book, "a", 480.0, 520.0)  # renewed (episode claimed from 480): counted from 500, the first report
    renew(book, "b", 480.0, 520.0)
    assert judge(book, "r1", ready_since=10.0, now=520.0, policy=POLICY).sick


def test_a_router_saying_its_episode_started_over_shortens_the_count():
    book = EjectionBook()
    renew(book, "a", 0.0, 30.0)
    renew(book, "b", 0.0, 30.0)
    assert judge(book, "r1", -1.0, 30.0, POLICY).sick
    book.observe("b", [entry("r1", 1.0)], 31.0)  # b saw a success and a new episode: 1 s so far
    v = judge(book, "r1", -1.0, 31.0, POLICY)
    assert not v.sick and "waiting" in v.reason
    (_, b) = book.for_replica("r1")
    assert b.counted_from == 30.0


def test_first_seen_is_per_worker_so_a_new_instance_id_starts_from_its_own_first_report():
    book = EjectionBook()
    renew(book, "a", 0.0, 50.0)
    book.observe("b", [entry("r1", 999.0)], 30.0, instance="w1")
    for i in range(20):  # a router inventing instances cannot buy time with them
        book.observe("b", [entry("r1", 999.0)], 30.0 + i, instance=f"new-{i}")
    assert not judge(book, "r1", -1.0, 49.0, POLICY).sick
    for t in (38.0, 46.0, 50.0):
        book.observe("b", [entry("r1", 999.0)], t, instance="w1")
    assert judge(book, "r1", -1.0, 50.0, POLICY).sick


def test_reports_about_other_replicas_do_not_add_up():
    book = EjectionBook()
    renew(book, "a", 0.0, 30.0, rid="r1")
    renew(book, "b", 0.0, 30.0, rid="r2")
    assert not judge(book, "r1", -1.0, 30.0, POLICY).sick
    assert not judge(book, "r2", -1.0, 30.0, POLICY).sick


def test_the_report_schema_names_the_offending_key():
    bad = {"ejections": [{"endpoint_id": "e", "replica_id": "", "reason": "x", "ejected_for_s": -1,
                          "consecutive_failures": 1, "extra": True}]}
    got = {e.pointer: e.message for e in schema_errors(bad, "router-ejections")}
    assert set(got) == {"/ejections/0/replica_id", "/ejections/0/ejected_for_s", "/ejections/0/extra"}
    assert schema_errors({"ejections": [entry()]}, "router-ejections") == []


def test_the_router_episode_lasts_from_the_first_ejection_until_a_success():
    policy = OutlierPolicy(Outlier(consecutive_errors=2, base_ejection=5.0, max_ejection=60.0,
                                   max_ejection_share=1.0))
    h = Health()
    assert not policy.on_failure(h, 0.0, 0, 2)
    assert h.episode_since is None
    assert policy.on_failure(h, 1.0, 0, 2)
    assert h.episode_since == 1.0 and h.episode_failures == 2
    # ejection over, back on probation: still the same episode, and one failure ejects again
    assert not h.is_ejected(7.0)
    assert policy.on_failure(h, 7.0, 0, 2)
    assert h.episode_since == 1.0 and h.episode_failures == 3
    policy.on_success(h, 30.0)
    assert h.episode_since is None and h.episode_failures == 0


def test_workers_of_one_router_count_as_one_router_with_its_longest_episode():
    book = EjectionBook()
    for t in (0.0, 2.0, 4.0, 30.0):
        book.observe("a", [entry("r1", t)], t, instance="w1")
        book.observe("a", [entry("r1", 1.0)], t, instance="w2")  # w2's episode keeps starting over
    v = judge(book, "r1", -1.0, 30.0, POLICY)
    assert not v.sick and v.routers == ("a",)  # two workers are still one router
    (rep,) = book.for_replica("r1")
    assert rep.since == 0.0  # w1's episode, the longest
    renew(book, "b", 10.0, 30.0)
    assert judge(book, "r1", -1.0, 30.0, POLICY).sick
    # w1 of router a falls silent: w2's short episode is all a says now
    for t in (32.0, 34.0, 36.0, 38.0, 40.0, 42.0):
        book.observe("a", [entry("r1", 1.0)], t, instance="w2")
        book.observe("b", [entry("r1", t - 10.0)], t)
    book.expire(42.0, POLICY.report_ttl)
    assert not judge(book, "r1", -1.0, 42.0, POLICY).sick
