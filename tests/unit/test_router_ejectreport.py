"""What a router reports about its ejected endpoints: episodes, not single ejections."""

from __future__ import annotations

from llmgw.config import schema_errors
from llmgw.router.balancing import LeastOutstanding
from llmgw.router.ejectreport import ejection_entries
from llmgw.router.endpoints import Endpoint, EndpointTable
from llmgw.router.metrics import RouterMetrics
from llmgw.router.runtime import Routing
from llmgw.router.settings import RouterSettings


def routing() -> Routing:
    settings = RouterSettings.from_config({"listen": {"port": 8080}, "insecure_http": True,
                                           "allow_unauthenticated": True,
                                           "outlier": {"consecutive_errors": 2, "max_ejection_share": 1.0}})
    table = EndpointTable([Endpoint("e1", "m", "http://127.0.0.1:9001", replica_id="r1"),
                           Endpoint("e2", "m", "http://127.0.0.1:9002", replica_id="r2")])
    return Routing(table, settings, RouterMetrics(), LeastOutstanding())


def test_only_endpoints_in_an_ejection_episode_are_reported_and_the_report_is_valid():
    r = routing()
    group = r.group("m")
    e1 = next(rt for rt in group.members if rt.id == "e1")
    assert ejection_entries(r, 0.0) == []
    r.record(e1, group, "status_5xx", failure=True)
    assert ejection_entries(r, 0.0) == []  # one failure is not an ejection
    r.record(e1, group, "status_5xx", failure=True)
    ejected_at = e1.health.episode_since
    assert ejected_at is not None
    (got,) = ejection_entries(r, ejected_at + 12.5)
    assert got["replica_id"] == "r1" and got["endpoint_id"] == "e1" and got["reason"] == "status_5xx"
    assert got["ejected_for_s"] == 12.5 and got["consecutive_failures"] == 2
    assert schema_errors({"instance": "w", "ejections": [got]}, "router-ejections") == []
    # a success ends the episode: nothing more to report
    r.record(e1, group, "ok", failure=False)
    assert ejection_entries(r, ejected_at + 13.0) == []
