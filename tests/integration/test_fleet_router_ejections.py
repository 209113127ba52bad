"""Routers' ejections reach the control plane and replace a replica only when enough routers agree.

Real processes: the control plane, three one-GPU agents running the engine
simulator, two standalone routers (each with its own router certificate),
and the official ``openai`` client streaming through them.  Every engine
carries ``LLMGW_SIM_FAULT=http-500`` with onset on SIGUSR1; the victim is
signalled after it has served, so its completions answer 500 while its
``/health`` stays 200 and the agent's liveness keeps passing.

1. Traffic through router A only: A ejects the victim and reports it; well
   past ``sick_after`` the replica is still Ready, and ``ctl replicas`` shows
   A's report with the reason it is not acted on (one router is never enough).
   The control plane is killed and restarted: A's re-sent report brings the
   episode back whole, and the replica is still kept.
2. Traffic through router B as well: B ejects it too, the quorum of two is
   reached, the replacement starts on the free node, is Ready, and only then
   is the victim drained.  No client request failed through either router.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from fleet import Fleet, log_times, metric_samples, router_endpoints, standalone_router, until
from llmgw.router.ejectreport import REPORT_INTERVAL
from llmgw.tls import issue_router
from llmgw.tls.files import write_pair
from openai_load import OpenAIStreams

pytestmark = pytest.mark.integration

PROFILE = {"env": {"LLMGW_SIM_TOKEN_LATENCY": "0.005", "LLMGW_SIM_FAULT": "http-500",
                   "LLMGW_SIM_FAULT_ONSET": "signal"}}
SICK_AFTER = 3.0
# retries generous enough that the victim's failures before its ejection are all retried elsewhere
ROUTER = {"outlier": {"consecutive_errors": 3}, "retries": {"budget_min": 50}}


def test_ejections_by_two_routers_replace_a_replica_and_one_router_alone_does_not(tmp_path):
    with Fleet(tmp_path, nodes={"a": 1, "b": 1, "c": 1}, replicas=2, profile=PROFILE) as f:
        f.config["router_ejections"] = {"sick_after": SICK_AFTER, "report_ttl": 5}
        f.write_config()
        f.start()
        ready = f.wait_ready(2)
        router_a, port_a = standalone_router(f, "router-a", ROUTER)
        router_b, port_b = standalone_router(f, "router-b", ROUTER)
        for port in (port_a, port_b):
            until(lambda: router_endpoints(port) == 2, "the routers to know both endpoints", on_timeout=f.dump)
        victim = ready[0]["replica_id"]
        victim_pid = ready[0]["shards"][0]["pid"]
        healthy = ready[1]["replica_id"]
        used = {r["shards"][0]["node_id"] for r in ready}
        free_node = next(n for n in f.node_ids.values() if n not in used)

        load_a = OpenAIStreams(f"http://127.0.0.1:{port_a}").start()
        load_b = None
        try:
            until(lambda: load_a.count() >= 5, "streams through router A", on_timeout=f.dump)
            os.kill(victim_pid, signal.SIGUSR1)  # its completions answer 500 from now on; /health stays 200

            # 1. router A alone reports it, for well past sick_after: the replica is kept
            def reported_long(by: int, for_s: float):
                def check():
                    r = _replica(f, victim)
                    ej = r and r.get("ejections")
                    return ej if ej and len(ej["routers"]) == by and all(
                        x["ejected_for_s"] >= for_s for x in ej["routers"]) else None
                return check
            ej = until(reported_long(1, 2 * SICK_AFTER + 2), "router A's report to last", on_timeout=f.dump)
            assert [x["router"] for x in ej["routers"]] == ["router-a"], ej
            assert "it takes 2 distinct routers" in ej["verdict"], ej
            r = _replica(f, victim)
            assert r["state"] == "ready" and r["sick"] is None, r
            assert not any(x.get("replaces") == victim for x in f.replicas()["replicas"])
            out = f.ctl("replicas").stdout
            assert "ejected by 1 router(s)" in out and "router router-a: for" in out, out
            out = f.ctl("explain", "tiny").stdout
            assert f"running as {victim} (ready)" in out and "routers report it ejected: ejected by 1" in out, out

            _only_routers_report_and_bad_reports_change_nothing(f)
            before = _replica(f, victim)["ejections"]["routers"][0]["ejected_for_s"]

            # a control-plane restart forgets nothing: router A's next report brings the whole episode back
            f.server.kill()
            f.server.start()
            f.wait_healthy()
            ej = until(reported_long(1, before + 0.1), "router A's report after the restart", on_timeout=f.dump)
            assert [x["router"] for x in ej["routers"]] == ["router-a"], ej
            assert _replica(f, victim)["state"] == "ready"

            # 2. router B sees it fail too: two routers agree, the replica is replaced make before break
            load_b = OpenAIStreams(f"http://127.0.0.1:{port_b}").start()
            b_started = time.time()

            def twin_seen():
                return next((x for x in f.replicas()["replicas"] if x.get("replaces") == victim), None)
            twin = until(twin_seen, "the replacement to be placed", on_timeout=f.dump)
            assert twin["shards"][0]["node_id"] == free_node
            r = _replica(f, victim)
            assert r["sick"] and "router-a" in r["sick"] and "router-b" in r["sick"], r
            final = f.wait_ready(2, extra=lambda rs: victim not in {x["replica_id"] for x in rs})
            assert {x["replica_id"] for x in final} == {healthy, twin["replica_id"]}
            served = load_a.count() + load_b.count()
            until(lambda: load_a.count() + load_b.count() >= served + 10, "streams after the replacement",
                  on_timeout=f.dump)
        finally:
            load_a.stop()
            if load_b is not None:
                load_b.stop()
        assert load_a.failures == [] and load_b.failures == [], (load_a.failures[:3], load_b.failures[:3])
        log = f.server.output(400000)
        assert f"{victim}: draining, {twin['replica_id']} on {free_node} is Ready in its place" in log
        until(lambda: victim_pid not in f.engine_pids(), "the sick engine to stop", on_timeout=f.dump)
        m = metric_samples(f)
        reports = {s[0]["router"]: s[1] for s in m["llmgw_router_ejection_reports_total"]}
        assert reports.get("router-a", 0) > 0 and reports.get("router-b", 0) > 0, reports  # since the restart
        assert m["llmgw_replicas_replaced_total"] == [({"reason": "router_ejections"}, 1.0)]
        judged = log_times(log, f"{victim}: judged sick")[0]
        replaced = log_times(log, "is Ready in its place")[-1]
        print(f"\nrouter ejections: {load_a.count() + load_b.count()} streams served, 0 failed; reports {reports}; "
              f"second router's traffic -> judged sick {judged - b_started:.1f}s (sick_after {SICK_AFTER:g}s), "
              f"-> replacement Ready {replaced - judged:.1f}s")


def _replica(f: Fleet, rid: str) -> dict | None:
    doc = f.try_get("/v1/replicas")
    return None if doc is None else next((r for r in doc["replicas"] if r["replica_id"] == rid), None)


def _only_routers_report_and_bad_reports_change_nothing(f: Fleet) -> None:
    good = {"ejections": [{"endpoint_id": "x", "replica_id": "x", "reason": "status_5xx", "ejected_for_s": 99,
                           "consecutive_failures": 9}]}
    with f.client() as admin:  # an operator's certificate may not speak for a router
        r = admin.post("/v1/router/ejections", json=good)
        assert r.status_code == 403 and "router certificate" in r.json()["error"], r.text
    node_cert = f.pki.node("someone")
    with f.client(cert=node_cert) as node:
        assert node.post("/v1/router/ejections", json=good).status_code == 403
    with f.client(cert=f.pki.router) as router:
        bad = {"ejections": [{**good["ejections"][0], "ejected_for_s": -1, "replica_id": 7}]}
        r = router.post("/v1/router/ejections", json=bad)
        assert r.status_code == 400, r.text
        assert {e["pointer"] for e in r.json()["errors"]} == {"/ejections/0/ejected_for_s", "/ejections/0/replica_id"}
        # a runaway router is held to its rate and answered 429; only it is affected
        codes = [router.post("/v1/router/ejections", content=b"{").status_code for _ in range(30)]
        assert codes.count(400) >= 15 and codes[-1] == 429, codes


def _router_cert(f: Fleet, name: str) -> tuple:
    return write_pair(f.pki.dir / name, *issue_router(f.pki.ca, [name, "localhost"], ["127.0.0.1"]))


def test_routers_claiming_a_long_ejection_wait_sick_after_and_replacements_are_bounded_and_16_workers_fit(tmp_path):
    """Two router certificates report both healthy replicas ejected for an hour: nothing is replaced on their
    first report (the count starts at the first report this control plane received); once ``sick_after`` has
    passed, one replica is replaced and the other is held by ``replacements_per_minute``.  One of the routers
    reports through 16 workers every 2 s, each its own ``instance``, and none of its 144 reports is refused.
    Non-finite and absurd numbers are refused with a 400 naming them."""
    workers, rounds = 16, 9
    with Fleet(tmp_path, nodes={"a": 1, "b": 1, "c": 1, "d": 1}, replicas=2) as f:
        f.config["router_ejections"] = {"sick_after": SICK_AFTER, "report_ttl": 5, "replacements_per_minute": 1}
        f.write_config()
        f.start()
        ready = f.wait_ready(2)
        rids = sorted(r["replica_id"] for r in ready)
        body = {"ejections": [{"endpoint_id": rid, "replica_id": rid, "reason": "status_5xx",
                               "ejected_for_s": 3600.0, "consecutive_failures": 50} for rid in rids]}
        with f.client(cert=_router_cert(f, "router-x")) as x, f.client(cert=_router_cert(f, "router-y")) as y:
            for field, bad, what in (("ejected_for_s", "NaN", "NaN is not a number"),
                                     ("ejected_for_s", "1e400", "1e400 is not a finite number"),
                                     ("consecutive_failures", "7" * 400, "a number of 400 characters")):
                entry = ", ".join(f'"{k}": {bad if k == field else json.dumps(v)}' for k, v in body["ejections"][0].items())
                r = x.post("/v1/router/ejections", content=f'{{"ejections": [{{{entry}}}]}}'.encode(),
                           headers={"Content-Type": "application/json"})
                assert r.status_code == 400 and what in r.json()["error"], r.text
            # Ready for longer than sick_after already: only the count from the first report holds them back
            until(lambda: all(((_replica(f, rid) or {}).get("ready_for_s") or 0) > SICK_AFTER for rid in rids),
                  "the replicas to have been Ready for sick_after", on_timeout=f.dump)

            codes: list[int] = []

            def report_round() -> None:
                for w in range(workers):
                    codes.append(x.post("/v1/router/ejections", json={"instance": f"w{w}", **body}).status_code)
                assert y.post("/v1/router/ejections", json={"instance": "w0", **body}).status_code == 202

            report_round()
            first = time.monotonic()

            def both_seen_twice():
                views = [_replica(f, rid) for rid in rids]
                return views if all(v and v.get("ejections") and len(v["ejections"]["routers"]) == 2
                                    and v["ejections"]["verdict"] for v in views) else None
            views = until(both_seen_twice, "both routers' reports to be judged", on_timeout=f.dump)
            if time.monotonic() - first < SICK_AFTER:  # judged before sick_after could pass since the report
                for v in views:  # today's main: "judged sick" at once, on the routers' word
                    assert v["sick"] is None and "waiting until 2 of them" in v["ejections"]["verdict"], v
                    assert all(rep["ejected_for_s"] >= 3600 for rep in v["ejections"]["routers"]), v
                assert not any(r.get("replaces") for r in f.replicas()["replicas"])

            for _ in range(rounds - 1):
                time.sleep(REPORT_INTERVAL)  # the routers' own schedule
                report_round()
            assert codes == [202] * (workers * rounds), codes  # a budget per router name refused 85 of 144

            def one_replaced_one_held():
                held = [v for v in (_replica(f, rid) for rid in rids) if v and v.get("ejections")
                        and "held: 1 replica(s) replaced" in (v["ejections"]["verdict"] or "")]
                replaced = metric_samples(f).get("llmgw_replicas_replaced_total")
                if held and replaced:
                    return held[0], replaced
                report_round()
                return None
            held, replaced = until(one_replaced_one_held, "one replacement, the other held by the bound",
                                   on_timeout=f.dump, interval=REPORT_INTERVAL)
            assert replaced == [({"reason": "router_ejections"}, 1.0)]
            assert held["sick"] is None and "replacements_per_minute is 1" in held["ejections"]["verdict"]
            (sick,) = [rid for rid in rids if rid != held["replica_id"]]
            log = f.server.output(400000)
            assert log.count(": judged sick (") == 1 and f"{sick}: judged sick (" in log
