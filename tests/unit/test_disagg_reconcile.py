"""A disaggregated deployment through the reconciler: both groups placed where transfers reach, roles published."""

from __future__ import annotations

from reconciler_fleet import Fleet, inventory, make_ready, starts

from llmgw.catalog import Catalog
from llmgw.controlplane.reconcile.endpoints import endpoints


def pd_catalog(prefill: int = 1, decode: int = 1) -> Catalog:
    return Catalog.from_config({
        "models": [{"name": "tiny", "source": "/models/tiny"}],
        "profiles": [{"name": "sim", "engine": "vllm", "start_timeout": 60}],
        "deployments": [{"model": "tiny", "profile": "sim", "disaggregation": {
            "connector": "nixl", "prefill": {"replicas": prefill}, "decode": {"replicas": decode}}}],
    })


def test_the_decode_group_follows_the_prefill_group_onto_its_fabric():
    f = Fleet("a", "b", "c", gpus=1, fabric="ib-a")
    f.set("b", inventory=inventory("b", 1, "ib-b"))
    plan = f.step(pd_catalog(), 0.0)
    got = {s.spec["profile"]["name"]: s for s in starts(plan)}
    assert set(got) == {"sim:prefill", "sim:decode"}
    pre, dec = got["sim:prefill"], got["sim:decode"]
    assert pre.node_id == "a" and dec.node_id == "c"  # b is on another fabric: no path to a
    assert pre.spec["profile"]["kv_transfer"] == {"connector": "nixl", "role": "prefill"}
    assert dec.spec["profile"]["kv_transfer"] == {"connector": "nixl", "role": "decode"}
    assert dec.spec["env"] == {"UCX_NET_DEVICES": "mlx5_0:1"}
    r = f.rec.book.replicas[dec.spec["replica_id"]]
    assert r.placement_detail.startswith("decode: ") and "over fabric ib-a" in r.placement_detail


def test_a_decode_replica_with_no_reachable_node_waits_and_says_why():
    f = Fleet("a", "b", gpus=1, fabric="ib-a")
    f.set("b", inventory=inventory("b", 1, "ib-b"))
    plan = f.step(pd_catalog(), 0.0)
    assert [s.node_id for s in starts(plan)] == ["a"]
    (why,) = plan.unplaced.values()
    assert why.startswith("decode: ") and "no path to the prefill replicas" in why


def test_the_endpoints_carry_each_replicas_role():
    f = Fleet("a", "b", gpus=1, fabric="ib-a")
    cat = pd_catalog()
    f.step(cat, 0.0)
    make_ready(f, 1.0)
    f.step(cat, 1.0)
    roles = {e["id"].split(".")[1]: e.get("role") for e in endpoints(f.rec.book, f.nodes)}
    assert roles == {"sim:prefill": "prefill", "sim:decode": "decode"}
    assert all(e["model"] == "tiny" for e in endpoints(f.rec.book, f.nodes))


def sglang_pair() -> tuple[Fleet, Catalog]:
    cat = Catalog.from_config({
        "models": [{"name": "tiny", "source": "/models/tiny"}],
        "profiles": [{"name": "sg", "engine": "sglang", "start_timeout": 60}],
        "deployments": [{"model": "tiny", "profile": "sg", "disaggregation": {
            "connector": "nixl", "prefill": {"replicas": 1}, "decode": {"replicas": 1}}}],
    })
    f = Fleet("a", "b", gpus=1, fabric="ib-a")
    f.step(cat, 0.0)
    make_ready(f, 1.0)
    f.step(cat, 1.0)
    return f, cat


def test_an_sglang_prefill_endpoint_names_its_bootstrap_once_its_agent_said_which_port():
    f, _ = sglang_pair()
    by_role = {e["role"]: e for e in endpoints(f.rec.book, f.nodes)}
    assert set(by_role) == {"decode"}  # the prefill's bootstrap port is not known yet: it cannot be used
    assert by_role["decode"]["requires_prefill"] is True
    (prefill,) = [r for r in f.rec.book.replicas.values() if ":prefill." in r.replica_id]
    prefill.shards[0].side_port = 20417
    by_role = {e["role"]: e for e in endpoints(f.rec.book, f.nodes)}
    assert by_role["prefill"]["bootstrap_port"] == 20417 and "requires_prefill" not in by_role["prefill"]
    assert "bootstrap_port" not in by_role["decode"]


def test_vllm_pairs_carry_neither_bootstrap_nor_a_prefill_requirement():
    f = Fleet("a", "b", gpus=1, fabric="ib-a")
    cat = pd_catalog()
    f.step(cat, 0.0)
    make_ready(f, 1.0)
    f.step(cat, 1.0)
    for r in f.rec.book.replicas.values():
        r.shards[0].side_port = 20000
    for e in endpoints(f.rec.book, f.nodes):
        assert "bootstrap_port" not in e and "requires_prefill" not in e
