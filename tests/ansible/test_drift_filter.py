"""drift.yml's node and deployment comparisons (plugins/filter/drift.py: drift_nodes,
drift_deployments), on variables shaped as the llmgw.fleet.llmgw inventory plugin sets them. The same
kinds are checked end to end against a real fleet in tests/inventory/test_inventory_live.py.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest
from ansible.errors import AnsibleFilterError

from fleet_harness import PLUGINS, REPO, load_plugin

drift = load_plugin(PLUGINS / "filter" / "drift.py")

URL = "https://cp.example:8443"
NOW = datetime(2026, 6, 1, tzinfo=timezone.utc).timestamp()


def _live(**over):
    hv = {"llmgw_live_state": "ready", "llmgw_live_state_for_s": 12.5, "llmgw_live_reason": None,
          "llmgw_live_agent_version": "1.2.0", "llmgw_live_fabrics": [], "llmgw_fabrics": [],
          "llmgw_live_certificate": {"serial": "0a", "not_after": "2027-06-01T00:00:00+0000"}}
    hv.update(over)
    return hv


def _run(declared, live, hostvars, version="1.2.0"):
    return drift.drift_nodes(declared, live, hostvars, url=URL, version=version, now=NOW, renew_days=30,
                             agent_group="llmgw_agents")


def _kinds(out):
    return [(d["kind"], d["node"]) for d in out]


def test_a_clean_fleet_has_no_difference():
    hv = {"gpu0": _live(), "gpu1": _live()}
    assert _run(["gpu0", "gpu1"], ["gpu1", "gpu0"], hv) == []


def test_declared_but_not_registered_and_registered_but_not_declared():
    hv = {"gpu0": {}, "gpu1": _live(), "stray": _live(llmgw_live_state="cordoned", llmgw_live_agent_version="1.1.0")}
    out = _run(["gpu0", "gpu1"], ["gpu1", "stray"], hv)
    assert _kinds(out) == [("node_not_registered", "gpu0"), ("node_not_declared", "stray")]
    assert out[0]["message"] == "gpu0: declared, but not registered with the control plane at " + URL
    assert out[1]["message"] == "stray: registered (cordoned, agent 1.1.0), but not declared in llmgw_agents"
    assert all(d["model"] is None for d in out)


def test_a_node_not_ready_says_for_how_long_and_why():
    hv = {"gpu0": _live(llmgw_live_state="unreachable", llmgw_live_state_for_s=41.0, llmgw_live_reason="no heartbeat"),
          "gpu1": _live(llmgw_live_state="draining")}
    out = _run(["gpu0", "gpu1"], ["gpu0", "gpu1"], hv)
    assert [d["message"] for d in out] == ["gpu0: unreachable for 41.0s: no heartbeat", "gpu1: draining for 12.5s"]


def test_agent_version_declared_per_host_wins_over_the_sources():
    hv = {"gpu0": _live(llmgw_live_agent_version="1.1.0"),
          "gpu1": _live(llmgw_live_agent_version="1.1.0", llmgw_agent_version="1.1.0")}
    out = _run(["gpu0", "gpu1"], ["gpu0", "gpu1"], hv)
    assert [d["message"] for d in out] == ["gpu0: agent 1.1.0 is running, 1.2.0 is declared"]


def test_fabrics_not_reported_hcas_not_advertised_and_rates():
    declared = [{"name": "ib0", "hcas": ["mlx5_0", "mlx5_1"], "min_rate_gbps": 400},
                {"name": "ib1", "hcas": ["mlx5_2"]},
                {"name": "ib2", "hcas": ["mlx5_3"], "min_rate_gbps": 200}]
    live = [{"name": "ib0", "advertised_hcas": ["mlx5_0"], "problems": ["mlx5_1: port 1 is DOWN", "mlx5_9: other"],
             "rate_gbps": 200},
            {"name": "ib2", "advertised_hcas": ["mlx5_3"], "problems": [], "rate_gbps": None}]
    out = _run(["gpu0"], ["gpu0"], {"gpu0": _live(llmgw_fabrics=declared, llmgw_live_fabrics=live)})
    assert _kinds(out) == [("hca_not_advertised", "gpu0"), ("fabric_rate_below_minimum", "gpu0"),
                           ("fabric_not_reported", "gpu0"), ("fabric_rate_unknown", "gpu0")]
    assert out[0]["message"] == "gpu0: fabric ib0: declared HCA mlx5_1 is not advertised: mlx5_1: port 1 is DOWN"
    assert out[1]["message"] == "gpu0: fabric ib0: rate 200 Gb/s is below the declared minimum 400 Gb/s"
    assert "fabric ib1 is declared but the agent does not report it (its agent.yaml" in out[2]["message"]
    assert out[3]["message"] == "gpu0: fabric ib2: rate unknown, declared minimum 200 Gb/s cannot be checked"


def test_an_hca_the_agent_does_not_declare_points_at_site_yml():
    live = [{"name": "ib0", "advertised_hcas": [], "problems": [], "rate_gbps": None}]
    out = _run(["gpu0"], ["gpu0"], {"gpu0": _live(llmgw_fabrics=[{"name": "ib0", "hcas": ["mlx5_0"], "min_rate_gbps": 400}],
                                                  llmgw_live_fabrics=live)})
    # No rate check without an advertised HCA: the missing HCA is the difference.
    assert _kinds(out) == [("hca_not_advertised", "gpu0")]
    assert out[0]["message"].endswith("is not advertised: the agent does not declare it (its agent.yaml was not rendered"
                                      " from this declaration: run site.yml)")


def _not_after(days):
    return (datetime.fromtimestamp(NOW, timezone.utc) + timedelta(days=days)).strftime("%Y-%m-%dT%H:%M:%S%z")


def test_the_presented_certificate_is_judged_against_the_hosts_renewal_window():
    hv = {"gpu0": _live(llmgw_live_certificate={"serial": "1f", "not_after": _not_after(10)}),
          "gpu1": _live(llmgw_live_certificate={"serial": "2f", "not_after": _not_after(10)}, llmgw_pki_renew_days=5),
          "gpu2": _live(llmgw_live_certificate={"serial": "3f", "not_after": _not_after(40)})}
    out = _run(["gpu0", "gpu1", "gpu2"], ["gpu0", "gpu1", "gpu2"], hv)
    assert _kinds(out) == [("certificate_expiring", "gpu0")]
    assert out[0]["message"] == ("gpu0: the certificate the agent presented to the control plane (serial 1f) expires "
                                 + _not_after(10) + ", within the renewal window of 30 days: run site.yml to re-issue it")


def test_without_a_presented_certificate_the_file_read_from_the_node_counts():
    hv = {"gpu0": {"_drift_cert": {"path": "/etc/llmgw/tls/node.crt", "error": "unreachable", "expiring": False}},
          "gpu1": {"_drift_cert": {"path": "/etc/llmgw/tls/node.crt", "error": "", "expiring": "True",
                                   "not_after": "20260605000000Z", "renew_days": "30"}},
          "gpu2": {"_drift_cert": {"path": "/etc/llmgw/tls/node.crt", "error": "", "expiring": False}},
          "gpu3": {}}
    out = _run(["gpu0", "gpu1", "gpu2", "gpu3"], [], hv)
    assert _kinds(out) == [("node_not_registered", "gpu0"), ("certificate_unchecked", "gpu0"),
                           ("node_not_registered", "gpu1"), ("certificate_expiring", "gpu1"),
                           ("node_not_registered", "gpu2"), ("node_not_registered", "gpu3")]
    assert out[1]["message"] == ("gpu0: the control plane reports no certificate for it, and /etc/llmgw/tls/node.crt"
                                 " could not be read from the node: unreachable")
    assert out[3]["message"] == ("gpu1: certificate /etc/llmgw/tls/node.crt read from the node (the control plane reports"
                                 " none) expires 20260605000000Z, within the renewal window of 30 days: run site.yml to re-issue it")


def test_each_hosts_variables_are_read_once():
    """The comparison is one pass: ansible-core assembles a host's variables on every
    ``hostvars[host]``, which is what made the Jinja loop cost time in the square of the fleet."""
    reads = []

    class Counting(dict):
        def __getitem__(self, host):
            reads.append(host)
            return super().__getitem__(host)

    hv = Counting({"gpu%d" % i: _live() for i in range(50)})
    names = sorted(hv)
    assert _run(names, list(reversed(names)), hv) == []
    assert sorted(reads) == names


def test_bad_input_is_a_clear_error():
    with pytest.raises(AnsibleFilterError, match="declared and the live node names as lists"):
        _run("gpu0", [], {})
    with pytest.raises(AnsibleFilterError, match="now must be a timestamp"):
        drift.drift_nodes([], [], {}, url=URL, version="1", now="soon", renew_days=30, agent_group="g")


# ---------------------------------------------------------------- deployments
AUTOSCALE = {"min": 1, "max": 4, "signal": "outstanding", "target": 8.0, "stable_window": 60.0, "panic_window": 6.0,
             "panic_threshold": 2.0, "tolerance": 0.1, "scale_down_cooldown": 300.0, "max_step": 4, "priority": 0}


def _scaled(ready, current, desired, reason="stable", **block):
    """A live deployment as the plugin shows an autoscaled one (started from replicas: 2)."""
    return {"replicas": 2, "ready": ready, "current": current, "desired": desired, "reason": reason,
            "autoscale": dict(AUTOSCALE, **block)}


def _dep(**over):
    return dict({"model": "qwen", "profile": "tp1", "replicas": 2}, **over)


def test_a_static_deployment_short_of_ready_replicas_says_why():
    live = {"qwen/tp1": {"replicas": 1, "ready": 1, "not_ready": [{"replica_id": "qwen/tp1#1-ab", "state": "starting"}],
                         "unplaced": [{"slot": 1, "reason": "no GPU free"}],
                         "explain": [{"placed": False, "text": "qwen/tp1#1: nowhere\n\n  gpu0 no"}, {"placed": True, "text": "x"}]}}
    (diff,) = drift.drift_deployments([_dep()], live)
    assert (diff["kind"], diff["model"], diff["profile"], diff["declared"], diff["ready"]) == ("replicas_short", "qwen", "tp1", 2, 1)
    assert diff["message"] == (
        "qwen/tp1: 1 of 2 declared replicas Ready\n"
        "  the control plane's catalog asks for 1 (server.yaml was not rendered from this declaration: run site.yml)\n"
        "  qwen/tp1#1-ab starting\n  qwen/tp1#1 not placed: no GPU free\n  qwen/tp1#1: nowhere\n\n    gpu0 no")
    assert drift.drift_deployments([_dep()], {"qwen/tp1": {"replicas": 2, "ready": 2}}) == []
    (missing,) = drift.drift_deployments([_dep()], {})
    assert missing["message"].startswith("qwen/tp1: 0 of 2 declared replicas Ready\n  the control plane's catalog asks for 0")


def test_an_autoscaled_count_away_from_replicas_or_min_is_not_drift():
    declared = [_dep(autoscale={"min": 1, "max": 4, "target": 8})]
    for ready, current, desired in ((1, 1, 1), (4, 4, 4), (1, 3, 3), (2, 2, 2)):
        assert drift.drift_deployments(declared, {"qwen/tp1": _scaled(ready, current, desired)}) == []
    # the same live state is drift for a fixed count of 2
    assert [d["kind"] for d in drift.drift_deployments([_dep()], {"qwen/tp1": dict(_scaled(1, 1, 1), autoscale=None)})] == [
        "replicas_short"]


def test_an_autoscaled_count_outside_the_declared_bounds_is_drift():
    declared = [_dep(autoscale={"min": 2, "max": 3})]
    live = {"qwen/tp1": dict(_scaled(1, 2, 2, reason="min", min=2, max=3),
                             not_ready=[{"replica_id": "qwen/tp1#1-cd", "state": "failed", "reason": "exited 1"}])}
    (low,) = drift.drift_deployments(declared, live)
    assert (low["kind"], low["min"], low["max"], low["ready"], low["desired"]) == ("autoscale_below_min", 2, 3, 1, 2)
    assert low["message"] == ("qwen/tp1: 1 Ready, below the declared min of 2 (autoscale 2..3, desired 2 (min))\n"
                              "  qwen/tp1#1-cd failed: exited 1")
    (high,) = drift.drift_deployments(declared, {"qwen/tp1": _scaled(3, 4, 3, min=2, max=3)})
    assert high["kind"] == "autoscale_above_max"
    assert high["message"] == "qwen/tp1: 4 replicas running, above the declared max of 3 (autoscale 2..3, desired 3 (stable))"


def test_a_deployment_that_lent_its_gpus_is_below_min_by_its_own_setting_not_drift():
    declared = [_dep(autoscale={"min": 1, "max": 2, "sleep": {"after": 60, "lend": True}})]
    live = {"qwen/tp1": _scaled(0, 0, 0, reason="lent", max=2, sleep={"after": 60.0, "level": 1, "lend": True})}
    assert drift.drift_deployments(declared, live) == []
    live["qwen/tp1"]["reason"] = "min"  # at zero for any other reason it is
    assert [d["kind"] for d in drift.drift_deployments(declared, live)] == ["autoscale_below_min"]


def test_declared_bounds_that_differ_from_the_live_catalogs_are_drift():
    live = {"qwen/tp1": _scaled(2, 2, 2)}
    (diff,) = drift.drift_deployments([_dep(autoscale={"max": 6, "target": 8, "sleep": {"after": 300}})],
                                      {"qwen/tp1": _scaled(2, 2, 2, sleep={"after": 300.0, "level": 1})})
    assert diff["kind"] == "autoscale_bounds"
    assert diff["message"] == ("qwen/tp1: autoscale 1..6 declared, 1..4 in the control plane's catalog: max 6 declared, "
                               "4 live (server.yaml was not rendered from this declaration: run site.yml)")
    # min left out means the schema's default; every other key compared only when declared
    (diff,) = drift.drift_deployments([_dep(autoscale={"max": 4, "priority": 10})],
                                      {"qwen/tp1": _scaled(2, 2, 2, min=2)})
    assert "min 1 declared, 2 live; priority 10 declared, 0 live" in diff["message"]
    assert drift.drift_deployments([_dep(autoscale={"min": 1, "max": 4, "stable_window": 60})], live) == []


def test_autoscaled_on_one_side_only_is_drift():
    (fixed_live,) = drift.drift_deployments([_dep(autoscale={"max": 4})], {"qwen/tp1": {"replicas": 2, "ready": 2}})
    assert fixed_live["kind"] == "autoscale_bounds"
    assert fixed_live["message"].startswith("qwen/tp1: declared to autoscale 1..4, but the control plane's catalog has "
                                            "a fixed count of 2 (server.yaml")
    (absent,) = drift.drift_deployments([_dep(autoscale={"max": 4})], {})
    assert "the control plane's catalog does not have it" in absent["message"]
    (scaled_live,) = drift.drift_deployments([_dep()], {"qwen/tp1": _scaled(1, 1, 1)})
    assert scaled_live["message"].startswith("qwen/tp1: declared with a fixed count of 2, but the control plane's catalog "
                                             "autoscales it 1..4")


def test_deployments_bad_input_is_a_clear_error():
    with pytest.raises(AnsibleFilterError, match="expected llmgw_deployments"):
        drift.drift_deployments({"model": "qwen"}, {})
    with pytest.raises(AnsibleFilterError, match="not a mapping"):
        drift.drift_deployments(["qwen"], {})


def test_the_autoscale_min_default_is_the_schemas():
    schema = json.loads((REPO / "agent" / "llmgw" / "schemas" / "server.schema.json").read_text())
    assert drift.AUTOSCALE_MIN_DEFAULT == schema["$defs"]["autoscale"]["properties"]["min"]["default"]
