"""llmgw.fleet.hca_validate over every recorded sysfs tree, through ansible-playbook.

Each case is run four times (check, apply, check, apply): the module only reads,
so no run may report a change, and check mode must find exactly what a real
run finds. Failures must name the node and every adapter at fault.
"""

from __future__ import annotations

import pytest

from fleet_harness import FIXTURES, PLAYBOOKS, four_runs

SYSFS = FIXTURES / "sysfs"
BOTH = [{"name": "ib0", "hcas": ["mlx5_0", "mlx5_1"]}]


def case(name, fixture, fabrics, *, ok, rate=None, names=(), found=(), undeclared=()):
    return {
        "name": name,
        "sysfs_root": str(SYSFS / fixture / "class" / "infiniband"),
        "fabrics": fabrics,
        "expect": {"ok": ok, "rate": rate, "names": names, "found": found, "undeclared": list(undeclared)},
        "fixture": fixture,
    }


CASES = [
    case("healthy", "healthy", BOTH, ok=True, rate=200.0),
    case("mixed-rates", "mixed_rates", BOTH, ok=True, rate=100.0),
    case(
        "mixed-rates-below-min", "mixed_rates", [{"name": "ib0", "hcas": ["mlx5_0", "mlx5_1"], "min_rate_gbps": 200}],
        ok=False, rate=100.0, found=["rate 100 Gb/s is below min_rate_gbps 200 (slowest: mlx5_1 port 1, 100 Gb/sec (4X EDR))"],
    ),
    case("pcie8-four-adapters", "pcie8", [{"name": "ib0", "hcas": ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]}],
         ok=True, rate=200.0),
    case("mixed-link-layer", "mixed_link_layer", BOTH, ok=False, rate=200.0, names=["mlx5_1"],
         found=["mlx5_1: port 1 is Ethernet (RoCE), fabric ib0 is InfiniBand (taken from mlx5_0 port 1): InfiniBand "
                "and RoCE ports cannot talk to each other; not advertised"]),
    case("roce-gid", "roce_gid", [{"name": "roce0", "hcas": ["mlx5_0"]}], ok=True, rate=100.0),
    case("phys-recovery", "phys_recovery", BOTH, ok=False, rate=200.0, names=["mlx5_1"],
         found=["mlx5_1: port 1 is ACTIVE but phys LinkErrorRecovery: the physical link is not up; not advertised"]),
    case("dualport-by-port", "dualport", [{"name": "ib0", "hcas": ["mlx5_0:1", "mlx5_1:1"]},
                                          {"name": "ib1", "hcas": ["mlx5_1:2"]}], ok=True, rate=200.0),
    case("swapped-names", "swapped",
         [{"name": "ib0", "hcas": ["mlx5_0"], "identities": {"mlx5_0": {"node_guid": "b83f:d203:0012:a4e0"}}}],
         ok=False, rate=None, names=["mlx5_0"], undeclared=["mlx5_1"],
         found=["not the card recorded at rollout", "the recorded card is now mlx5_1: renamed at boot?"]),
    case("vf-zero-guid-swapped", "vf_zero_guid",
         [{"name": "ib0", "hcas": ["mlx5_0"],
           "identities": {"mlx5_0": {"node_guid": "0000:0000:0000:0000", "pci_bus_id": "0000:19:00.0"}}}],
         ok=False, rate=None, names=["mlx5_0"], undeclared=["mlx5_1"],
         found=["not the card recorded at rollout (now node GUID 0000:0000:0000:0000, PCI 0000:1a:00.0",
                "the recorded card is now mlx5_1: renamed at boot?"]),
    case("multiport", "multiport", [{"name": "ib0", "hcas": ["mlx4_0"]}], ok=True, rate=56.0),
    case("roce", "roce", [{"name": "roce0", "hcas": ["mlx5_bond_0"]}], ok=True, rate=100.0),
    case("missing-adapter", "missing_adapter", BOTH, ok=False, rate=200.0, names=["mlx5_1"], found=["absent (found: mlx5_0)"]),
    case("port-init", "port_init", BOTH, ok=False, rate=200.0, names=["mlx5_1"], found=["INIT", "LinkUp", "subnet manager"]),
    case("port-down", "port_down", BOTH, ok=False, rate=200.0, names=["mlx5_1"], found=["DOWN", "Polling"]),
    case("port-armed", "port_armed", BOTH, ok=False, rate=200.0, names=["mlx5_1"], found=["ARMED"]),
    case(
        "renamed", "renamed", BOTH, ok=False, rate=200.0, names=["mlx5_0"],
        found=["absent (found: mlx5_1, mlx5_2)", "mlx5_2 (node GUID b83f:d203:0012:a4e0)"], undeclared=["mlx5_2"],
    ),
    case(
        "malformed", "malformed", BOTH, ok=False, rate=None, names=["mlx5_0", "mlx5_1"],
        found=["state: expected '<number>: <name>', got ''", "rate is unknown [rate: missing]; the fabric's rate is unknown"],
    ),
    case("no-rdma-nothing-declared", "no_such_tree", [], ok=True, rate=None),
    case("no-rdma-adapter-declared", "no_such_tree", BOTH, ok=False, names=["mlx5_0", "mlx5_1"], found=["absent (found: none)"]),
]


def test_every_fixture_has_a_case():
    trees = {p.name for p in SYSFS.iterdir() if (p / "class" / "infiniband").is_dir()}
    covered = {c["fixture"] for c in CASES}
    assert trees - covered == set(), f"sysfs fixtures without a case: {sorted(trees - covered)}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cases = [{k: c[k] for k in ("name", "sysfs_root", "fabrics")} for c in CASES]
    return four_runs(PLAYBOOKS / "hca_validate.yml", tmp_path_factory.mktemp("hca"), extravars={"cases": cases})


def _item_results(run):
    results = {r.item["name"]: r for r in run.task("Validate adapters")}
    assert set(results) == {c["name"] for c in CASES}, run.explain()
    return results


@pytest.mark.parametrize("run_index", range(4), ids=["check", "apply", "check-again", "apply-again"])
def test_never_changes_anything(runs, run_index):
    run = runs[run_index]
    assert run.changed() == 0, run.explain()
    assert not any(r.changed for r in _item_results(run).values())


@pytest.mark.parametrize("c", CASES, ids=[c["name"] for c in CASES])
def test_case(runs, c):
    expect = c["expect"]
    for run in runs:  # check mode sees exactly what a real run sees
        res = _item_results(run)[c["name"]]
        assert (res.status == "ok") == expect["ok"], res.res
        out = res.res
        assert out["ok"] is expect["ok"]
        assert out["fabric_rate_gbps"] == expect["rate"]
        assert out["undeclared_hcas"] == expect["undeclared"]
        declared = [h for f in c["fabrics"] for h in f["hcas"]]
        assert [ch["hca"] for ch in out["checks"]] == declared
        if expect["ok"]:
            assert out["problems"] == []
            assert all(ch["ok"] and ch["active_ports"] for ch in out["checks"])
            continue
        msg = out["msg"]
        assert msg.startswith(c["name"] + ": "), msg  # the node comes first
        for name in expect["names"]:
            assert f"{name}: " in msg, msg
            assert not next(ch for ch in out["checks"] if ch["hca"] == name)["ok"]
        for text in expect["found"]:
            assert text in msg, msg
        healthy = set(declared) - set(expect["names"])
        for ch in out["checks"]:
            if ch["hca"] in healthy:
                assert ch["ok"] and not ch["problems"], ch


def test_multiport_reports_the_down_port_without_failing(runs):
    out = _item_results(runs[1])["multiport"].res
    (check,) = out["checks"]
    assert check["active_ports"] == [1]
    assert [(p["port"], p["state"], p["phys_state"]) for p in check["ports"]] == [(1, "ACTIVE", "LinkUp"), (2, "DOWN", "Disabled")]


def test_fabric_status_matches_the_agents_shape(runs):
    out = _item_results(runs[1])["mixed-rates"].res
    (fabric,) = out["fabrics"]
    assert fabric["declared_hcas"] == fabric["advertised_hcas"] == ["mlx5_0", "mlx5_1"]
    assert fabric["rate_gbps"] == 100.0
    assert fabric["slowest_link"] == "mlx5_1 port 1, 100 Gb/sec (4X EDR)"
    roce = _item_results(runs[1])["roce"].res
    assert roce["checks"][0]["ports"][0]["link_layer"] == "Ethernet"


def test_roce_gid_index_ports_and_identities_as_the_agent_reports_them(runs):
    gid = _item_results(runs[1])["roce-gid"].res
    assert (gid["fabrics"][0]["link_layer"], gid["fabrics"][0]["gid_index"]) == ("Ethernet", 3)
    dual = _item_results(runs[1])["dualport-by-port"].res
    assert [f["advertised_hcas"] for f in dual["fabrics"]] == [["mlx5_0:1", "mlx5_1:1"], ["mlx5_1:2"]]
    assert dual["identities"]["mlx5_0"] == {"node_guid": "b83f:d203:0012:a4e0", "pci_bus_id": "0000:19:00.0"}
