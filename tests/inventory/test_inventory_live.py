"""llmgw.fleet.llmgw and playbooks/drift.yml against a real fleet.

One fleet for the module (control plane with its in-process router, two agents
with one simulated GPU each and a declared InfiniBand fabric checked against a
sysfs fixture, two Ready replicas of ``tiny``). Each drift test injects one difference, checks
that drift.yml reports exactly that kind, and puts the fleet back; the node
left silent comes last.
"""

from __future__ import annotations

import json
import re
import signal
from typing import Any

import ansible_runner
import pytest

from fleet import ADMIN_TOKEN, metric_samples, until
from livefleet import BIN, FABRICS, REPO, LiveFleet, ansible_env, plain, run, running

pytestmark = pytest.mark.integration

# Silence long enough to notice quickly, never long enough to lose a node here.
LIFECYCLE = {"unreachable_after": 4.0, "lost_after": 600.0}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    # the in-process router: an autoscaled deployment's signal (llmgw config validate refuses one without it)
    with running(tmp_path_factory.mktemp("live"), {"a": 1, "b": 1}, replicas=2, lifecycle=LIFECYCLE, router=True) as lf:
        yield lf


def differences(res) -> list[str]:
    """The '- ...' lines of drift.yml's failure, one per difference."""
    text = res.stdout
    block = text[text.index("drift: "):] if "drift: " in text else ""
    return [line.strip()[2:] for line in block.split("msg: |-", 1)[-1].splitlines() if line.strip().startswith("- ")]


def report(lf: LiveFleet, declared, tmp_path) -> tuple[object, dict]:
    path = tmp_path / "drift.json"
    res = lf.drift(declared, "-e", "drift_format=json", "-e", f"drift_report={path}")
    return res, json.loads(path.read_text())


def kinds(doc: dict) -> list[tuple[str, str | None]]:
    return sorted((d["kind"], d["node"] or d["model"]) for d in doc["differences"])


# ---------------------------------------------------------------- the plugin

def test_runner_inventory_merges_declared_and_live_on_the_same_hosts(live, tmp_path):
    declared = live.write_declared(live.declared())
    env = ansible_env(tmp_path)
    out, err = ansible_runner.get_inventory(action="list", inventories=[str(declared), str(live.plugin_config)],
                                            response_format="json", envvars=env, quiet=True)
    assert isinstance(out, dict), err
    out = plain(out)
    hv = out["_meta"]["hostvars"]
    replicas = live.fleet.replicas()["replicas"]
    nodes = live.fleet.nodes()
    for name in ("a", "b"):
        host = hv[live.node(name)]
        assert host["llmgw_live_certificate"] == nodes[live.node(name)]["certificate"]
        assert host["llmgw_fabrics"] == FABRICS  # declared
        assert host["llmgw_live_state"] == "ready"  # live
        assert host["llmgw_live_fabrics"][0]["advertised_hcas"] == ["mlx5_0", "mlx5_1"]
        assert host["llmgw_live_fabrics"][0]["rate_gbps"] == 200.0
        (shard,) = host["llmgw_live_shards"]
        (r,) = [r for r in replicas if r["shards"][0]["node_id"] == live.node(name)]
        assert (shard["replica_id"], shard["state"], shard["endpoint"], shard["gpus"]) == (
            r["replica_id"], "ready", r["endpoint"], r["shards"][0]["gpus"])
    for group in ("llmgw_agents", "llmgw_live", "llmgw_live_certified", "llmgw_state_ready", "llmgw_model_tiny",
                  "llmgw_fabric_ib_a"):
        assert sorted(out[group]["hosts"]) == sorted(live.fleet.node_ids.values()), group

    one, err = ansible_runner.get_inventory(action="host", host=live.node("a"), inventories=[str(live.plugin_config)],
                                            response_format="json", envvars=env, quiet=True)
    assert isinstance(one, dict), err
    one = plain(one)
    assert one["llmgw_live_shards"][0]["state"] == "ready"
    assert one["llmgw_live_agent_version"] == live.fleet.nodes()[live.node("a")]["agent_version"]


def test_admin_token_works_and_a_node_certificate_is_refused(live, tmp_path):
    pki = live.fleet.pki
    by_token = live.write_plugin_config("token.llmgw.yml", client_cert=None, client_key=None, token=ADMIN_TOKEN)
    inv = live.inventory_list(by_token)
    assert sorted(inv["llmgw_live"]["hosts"]) == sorted(live.fleet.node_ids.values())

    node_crt = live.tls["a"]
    as_node = live.write_plugin_config("node.llmgw.yml", client_cert=str(node_crt / "node.crt"),
                                       client_key=str(node_crt / "node.key"), ca_path=str(pki.ca_cert))
    res = run([str(BIN / "ansible-inventory"), "--list", "-i", str(as_node)], tmp_path)
    err = " ".join(res.stderr.split())
    assert res.returncode != 0
    assert f"the control plane at {live.fleet.url}/v1/nodes refused the credentials (HTTP 403)" in err
    assert "certificate role 'node' cannot act as an admin" in err


def test_nodes_and_replicas_are_read_in_pages_and_make_the_same_inventory(live, tmp_path):
    def list_reads() -> dict[str, float]:
        return {labels["route"]: v for labels, v in metric_samples(live.fleet).get("llmgw_admin_requests_total", [])
                if labels["method"] == "GET" and labels["route"] in ("/v1/nodes", "/v1/replicas")}

    whole = live.inventory_list(live.write_plugin_config("whole.llmgw.yml", page_size=0))
    before = list_reads()
    paged = live.inventory_list(live.write_plugin_config("paged.llmgw.yml", page_size=1))
    after = list_reads()
    replicas = len(live.fleet.get("/v1/replicas")["replicas"])
    assert after["/v1/nodes"] - before["/v1/nodes"] == len(live.fleet.node_ids), "one request per page of one node"
    assert after["/v1/replicas"] - before["/v1/replicas"] == replicas == 2, "one request per page of one replica"
    assert sorted(paged["llmgw_live"]["hosts"]) == sorted(whole["llmgw_live"]["hosts"]) == sorted(live.fleet.node_ids.values())
    for host in whole["llmgw_live"]["hosts"]:
        assert timeless(paged["_meta"]["hostvars"][host]) == timeless(whole["_meta"]["hostvars"][host])


def timeless(value: Any) -> Any:
    """``value`` without ages and the fleet summary: what two reads a moment apart must agree on."""
    if isinstance(value, dict):
        return {k: timeless(v) for k, v in value.items() if not k.endswith(("state_for_s", "last_seen_s", "_fleet"))}
    if isinstance(value, list):
        return [timeless(v) for v in value]
    return value


# ------------------------------------------------------------------- drift

def test_clean_fleet_reports_no_drift(live, tmp_path):
    res = live.drift(live.declared())
    assert res.returncode == 0, res.stdout
    out = " ".join(res.stdout.split())
    assert out.count("no drift") == 1
    assert f"no drift: 2 node(s) declared, 2 registered at {live.fleet.url}; 2 replica(s) Ready in 1 deployment(s)" in out
    res, doc = report(live, live.declared(), tmp_path)
    assert res.returncode == 0, res.stdout
    assert doc["ok"] is True and doc["differences"] == [] and doc["control_plane"] == live.fleet.url


def test_declared_node_not_registered_and_registered_node_not_declared(live, tmp_path):
    b = live.node("b")
    declared = live.declared(hosts={"gpu-never-started": {"llmgw_tls_dir": str(live.tls["a"])}, b: None})
    res, doc = report(live, declared, tmp_path)
    assert res.returncode != 0
    assert kinds(doc) == [("node_not_declared", b), ("node_not_registered", "gpu-never-started")]
    assert f"gpu-never-started: declared, but not registered with the control plane at {live.fleet.url}" in differences(res)


def test_fabric_rate_below_the_declared_minimum(live, tmp_path):
    a = live.node("a")
    faster = [{**FABRICS[0], "min_rate_gbps": 400}]
    res, doc = report(live, live.declared(hosts={a: {"llmgw_fabrics": faster}}), tmp_path)
    assert kinds(doc) == [("fabric_rate_below_minimum", a)]
    assert f"{a}: fabric ib-a: rate 200.0 Gb/s is below the declared minimum 400 Gb/s" in differences(res)


def test_declared_hca_not_advertised_with_the_agents_reason(live, tmp_path):
    a = live.node("a")
    edited = [{"name": "ib-a", "hcas": ["mlx5_0", "mlx5_2"]}]
    # declaration edited, not yet rolled out: the agent was never told about mlx5_2
    res, doc = report(live, live.declared(hosts={a: {"llmgw_fabrics": edited}}), tmp_path)
    assert kinds(doc) == [("hca_not_advertised", a)]
    assert "the agent does not declare it" in doc["differences"][0]["message"]
    # rolled out (agent.yaml rendered from it, agent restarted): the agent says why
    live.set_agent("a", fabrics=edited, sysfs="healthy")
    live.restart_agent("a")
    try:
        res, doc = report(live, live.declared(hosts={a: {"llmgw_fabrics": edited}}), tmp_path)
        assert kinds(doc) == [("hca_not_advertised", a)]
        assert (f"{a}: fabric ib-a: declared HCA mlx5_2 is not advertised: mlx5_2: absent (found: mlx5_0, mlx5_1)"
                in differences(res))
    finally:
        live.set_agent("a", fabrics=FABRICS, sysfs="healthy")
        live.restart_agent("a")


def test_replicas_ready_below_declared_with_the_placement_explanation(live, tmp_path):
    declared = live.declared(llmgw_deployments=[{"model": "tiny", "profile": "sim", "replicas": 3}])
    # declared, not rolled out: the control plane still asks for two
    res, doc = report(live, declared, tmp_path)
    assert kinds(doc) == [("replicas_short", "tiny")]
    assert "the control plane's catalog asks for 2" in doc["differences"][0]["message"]
    # rolled out (server.yaml rendered, reloaded): no capacity, and the placement says why
    cfg = live.fleet.config
    cfg["deployments"][0]["replicas"] = 3
    live.fleet.write_config()
    with live.fleet.client() as c:
        assert c.post("/v1/reload").status_code == 200
    try:
        until(lambda: any(u["slot"] == 2 for u in live.fleet.replicas()["unplaced"]), "slot 2 reported unplaced")
        res, doc = report(live, declared, tmp_path)
        assert kinds(doc) == [("replicas_short", "tiny")]
        (diff,) = doc["differences"]
        assert (diff["declared"], diff["ready"]) == (3, 2)
        assert diff["message"].startswith("tiny/sim: 2 of 3 declared replicas Ready")
        assert "asks for" not in diff["message"]
        assert "tiny/sim#2 not placed:" in diff["message"]
        for node in live.fleet.node_ids.values():
            assert re.search(rf"{re.escape(node)}\s+no\s+0 free GPUs", diff["message"]), diff["message"]
    finally:
        cfg["deployments"][0]["replicas"] = 2
        live.fleet.write_config()
        with live.fleet.client() as c:
            assert c.post("/v1/reload").status_code == 200


def reload(lf: LiveFleet) -> None:
    lf.fleet.write_config()
    with lf.fleet.client() as c:
        res = c.post("/v1/reload")
        assert res.status_code == 200, res.text


def test_an_autoscaled_deployment_shows_its_counts_and_drifts_only_on_its_bounds(live, tmp_path):
    # Rolled out autoscaled 1..2: with nothing in flight the count falls to min and one replica is drained.
    autoscale = {"min": 1, "max": 2, "target": 4, "stable_window": 1, "panic_window": 0.5, "scale_down_cooldown": 0}
    cfg = live.fleet.config
    cfg["deployments"][0]["autoscale"] = autoscale
    reload(live)
    try:
        until(lambda: [r["state"] for r in live.fleet.replicas()["replicas"]] == ["ready"], "tiny/sim scaled down to 1",
              on_timeout=live.fleet.dump)
        node = live.node("a")
        res = run([str(BIN / "ansible-inventory"), "--host", node, "-i", str(live.plugin_config)], tmp_path)
        assert res.returncode == 0, res.stderr
        dep = plain(json.loads(res.stdout))["llmgw_live_fleet"]["deployments"]["tiny/sim"]
        assert dep["autoscale"]["min"] == 1 and dep["autoscale"]["max"] == 2 and dep["autoscale"]["target"] == 4
        assert dep["autoscale"]["signal"] == "outstanding"  # the live catalog's block, defaults filled in
        assert (dep["replicas"], dep["ready"], dep["current"], dep["desired"], dep["reason"]) == (2, 1, 1, 1, "min")
        # Declared as rolled out: one Ready of `replicas: 2` is the moving count, not drift; a declared max the
        # control plane does not have is (the bounds compared are the live catalog's, through the plugin). Both
        # declarations of the one deployment go in one run: drift.yml compares each entry on its own.
        declared = live.declared(llmgw_deployments=[
            {"model": "tiny", "profile": "sim", "replicas": 2, "autoscale": autoscale},
            {"model": "tiny", "profile": "sim", "replicas": 2, "autoscale": {**autoscale, "max": 3}}])
        res, doc = report(live, declared, tmp_path)
        assert kinds(doc) == [("autoscale_bounds", "tiny")], res.stdout
        assert doc["differences"][0]["message"].startswith(
            "tiny/sim: autoscale 1..3 declared, 1..2 in the control plane's catalog: max 3 declared, 2 live")
    finally:
        del cfg["deployments"][0]["autoscale"]
        reload(live)
        live.fleet.wait_ready(2)


def test_agent_version_differing_from_the_declared_one(live, tmp_path):
    b = live.node("b")
    # The agent reports the installed distribution's version: put an older one first on its path.
    old = tmp_path / "old-agent"
    (old / "llmgw-0.0.9.dist-info").mkdir(parents=True)
    (old / "llmgw-0.0.9.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: llmgw\nVersion: 0.0.9\n")
    live.restart_agent("b", env_prefix=["env", f"PYTHONPATH={old}"])
    try:
        assert live.fleet.nodes()[b]["agent_version"] == "0.0.9"
        res, doc = report(live, live.declared(), tmp_path)
        assert kinds(doc) == [("agent_version", b)]
        assert f"{b}: agent 0.0.9 is running, 0.1.0 is declared" in differences(res)
    finally:
        live.restart_agent("b")


def test_certificate_expiring_within_the_renewal_window(live, tmp_path):
    a = live.node("a")
    before = live.fleet.nodes()[a]["certificate"]
    live.reissue_cert("a", days=2)
    try:
        # Only on disk so far: the agent still presents its 90-day certificate, and that is the one checked.
        # A declared node the control plane does not know has its file read from the node instead.
        res, doc = report(live, live.declared(hosts={"gpu-never-started": {"llmgw_tls_dir": str(live.tls["a"])}}), tmp_path)
        assert kinds(doc) == [("certificate_expiring", "gpu-never-started"), ("node_not_registered", "gpu-never-started")]
        (disk,) = [d["message"] for d in doc["differences"] if d["kind"] == "certificate_expiring"]
        assert f"{live.tls['a']}/node.crt read from the node (the control plane reports none)" in disk

        live.restart_agent("a")  # the agent now presents the 2-day certificate: the control plane accepted it
        presented = live.fleet.nodes()[a]["certificate"]
        assert presented["serial"] != before["serial"]
        res, doc = report(live, live.declared(), tmp_path)
        assert kinds(doc) == [("certificate_expiring", a)]
        message = doc["differences"][0]["message"]
        assert f"{a}: the certificate the agent presented to the control plane (serial {presented['serial']})" in message
        assert "within the renewal window of 30 days" in message
        ok, doc = report(live, live.declared(llmgw_pki_renew_days=1), tmp_path)
        assert ok.returncode == 0 and doc["differences"] == []

        # Renewed on disk but not loaded yet: the agent still presents the expiring one.
        live.reissue_cert("a", days=90)
        res, doc = report(live, live.declared(), tmp_path)
        assert kinds(doc) == [("certificate_expiring", a)]
    finally:
        live.reissue_cert("a", days=90)
        live.restart_agent("a")


def test_stopped_agent_is_reported_not_ready(live, tmp_path):
    b = live.node("b")
    live.fleet.agents["b"].signal(signal.SIGKILL)
    until(lambda: live.fleet.nodes()[b]["state"] == "unreachable", f"{b} unreachable", on_timeout=live.fleet.dump)
    res, doc = report(live, live.declared(), tmp_path)
    assert kinds(doc) == [("node_not_ready", b)]
    assert re.search(rf"^{re.escape(b)}: unreachable for [0-9.]+s: silent for", doc["differences"][0]["message"])


def test_no_live_inventory_fails_instead_of_passing(live, tmp_path):
    res = run([str(BIN / "ansible-playbook"), str(REPO / "playbooks" / "drift.yml"), "-i",
               str(live.write_declared(live.declared()))], tmp_path)
    assert res.returncode != 0
    assert "no live fleet in the inventory" in res.stdout
