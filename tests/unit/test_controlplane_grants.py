"""Grants: issue/verify/derive, the secret file, one GPU per node, and the reconciler's adoption rules."""

from __future__ import annotations

import os
import stat

import pytest

from llmgw.controlplane.gpuclaims import GpuOwners
from llmgw.controlplane.grants import Claim, GrantKeys, engine_key, issue, verify
from llmgw.controlplane.grantsecret import GrantSecretError, load_or_create
from llmgw.controlplane.reconciler import endpoints
from llmgw.controlplane.replicas import ReplicaState

from reconciler_fleet import KEYS, Fleet, catalog, granted, make_ready, report, starts, stops

A = GrantKeys((b"a" * 32,))
B = GrantKeys((b"b" * 32,))
CLAIM = Claim(node_id="n1", replica_id="tiny.sim.0-ab12", rank=0, nnodes=1, model="tiny", profile="sim")


def grant(keys: GrantKeys = A, **kw):
    fields = dict(replica_id=CLAIM.replica_id, slot=0, model="tiny", profile="sim", node_id="n1", rank=0, nnodes=1,
                  issued_at=1.7e9, cp_epoch=7, nonce="ab" * 16)
    return issue(keys, **{**fields, **kw})


def test_a_grant_verifies_for_exactly_what_it_was_issued_for():
    g = grant()
    v = verify(A, g, CLAIM)
    assert v.ok and v.secret == A.signing
    for change, word in (({"node_id": "n2"}, "node"), ({"rank": 1}, "rank"), ({"model": "other"}, "model"),
                         ({"profile": "big"}, "profile"), ({"replica_id": "tiny.sim.0-ffff"}, "replica"),
                         ({"nnodes": 2}, "nnodes")):
        v = verify(A, g, Claim(**{**CLAIM.__dict__, **change}))
        assert not v.ok and word in v.reason, (change, v.reason)


def test_a_tampered_forged_or_missing_grant_is_refused_with_a_reason():
    assert "no grant" in verify(A, None, CLAIM).reason
    assert "does not verify" in verify(A, {**grant(), "node_id": "n2"}, Claim(**{**CLAIM.__dict__, "node_id": "n2"})).reason
    assert "does not verify" in verify(A, grant(B), CLAIM).reason, "another control plane's secret"
    assert "malformed" in verify(A, {**grant(), "extra": 1}, CLAIM).reason
    assert "malformed" in verify(A, {**grant(), "rank": True}, CLAIM).reason
    assert "malformed" in verify(A, "grant", CLAIM).reason
    assert grant()["mac"] not in verify(A, grant(B), CLAIM).reason


def test_rotation_old_secrets_verify_and_keep_deriving_the_same_engine_key():
    g = grant(A)
    rotated = GrantKeys((b"c" * 32, A.signing))
    v = verify(rotated, g, CLAIM)
    assert v.ok and v.secret == A.signing
    assert engine_key(v.secret, CLAIM.replica_id, g["nonce"]) == engine_key(A.signing, CLAIM.replica_id, g["nonce"])
    assert verify(rotated, grant(rotated), CLAIM).secret == b"c" * 32


def test_engine_keys_differ_per_replica_nonce_and_secret():
    k = engine_key(A.signing, "r", "00")
    assert len(k) >= 32 and k == engine_key(A.signing, "r", "00")
    assert len({k, engine_key(A.signing, "r2", "00"), engine_key(A.signing, "r", "01"), engine_key(B.signing, "r", "00")}) == 4


def test_the_secret_file_is_made_once_private_and_reread(tmp_path):
    d = tmp_path / "cp"
    keys = load_or_create(d)
    path = d / "grant.key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(d.stat().st_mode) == 0o700
    assert load_or_create(d) == keys, "a restart reads the same secret"
    assert keys.signing.hex() not in repr(keys) and repr(keys.signing) not in repr(keys), "never printed"
    # rotation: a new first line signs, the old one still verifies
    new = "cd" * 32
    path.write_text(f"# rotated\n{new}\n{keys.signing.hex()}\n")
    rotated = load_or_create(d)
    assert rotated.signing == bytes.fromhex(new) and rotated.secrets[1] == keys.signing


@pytest.mark.parametrize("text,why", [("zz\n", "not hex"), ("abcd\n", "at least 32"), ("# only\n", "no secret")])
def test_a_bad_secret_file_refuses_to_start(tmp_path, text, why):
    (tmp_path / "grant.key").write_text(text)
    os.chmod(tmp_path / "grant.key", 0o600)
    os.chmod(tmp_path, 0o700)
    with pytest.raises(GrantSecretError, match=why):
        load_or_create(tmp_path)


def test_a_readable_secret_file_refuses_to_start(tmp_path):
    load_or_create(tmp_path / "cp")
    os.chmod(tmp_path / "cp" / "grant.key", 0o644)
    with pytest.raises(GrantSecretError, match="chmod 600"):
        load_or_create(tmp_path / "cp")


def test_a_second_node_with_another_nodes_gpu_uuids_is_refused_naming_both():
    owners = GpuOwners()
    hw = {"gpus": [{"uuid": "GPU-1"}, {"uuid": "GPU-2"}]}
    assert owners.problem("a", hw, lambda n: True) is None
    owners.record("a", hw)
    why = owners.problem("b", {"gpus": [{"uuid": "GPU-2"}, {"uuid": "GPU-9"}]}, lambda n: True)
    assert why is not None and "node b" in why and "node a" in why and "GPU-2" in why
    assert owners.problem("a", hw, lambda n: True) is None, "a node re-registering its own GPUs"
    assert owners.problem("b", hw, lambda n: False) is None, "a lost node holds nothing"
    owners.record("a", {"gpus": [{"uuid": "GPU-3"}]})
    assert owners.problem("b", hw, lambda n: True) is None, "a's GPUs changed: GPU-1/2 are free"


# ------------------------------------------------------------ reconciler rules

def impostor_spec(node: str, rid: str = "tiny.sim.0-beef") -> dict:
    return {"shard_id": f"{rid}/r0", "replica_id": rid, "rank": 0, "nnodes": 1, "gpu_indices": [0], "env": {},
            "master_addr": None, "master_port": None, "api_key": "k" * 43,
            "model": {"name": "tiny", "source": "/models/tiny", "served_name": "tiny", "size_bytes": 1 << 30},
            "profile": {"name": "sim", "engine": "vllm", "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                        "nodes": 1, "extra_args": [], "env": {}, "start_timeout": 60}}


def restarted(specs_by_node: dict, nodes=("a", "b"), keys=KEYS) -> Fleet:
    from llmgw.controlplane.reconciler import Reconciler
    g = Fleet(*nodes, gpus=1, rec=Reconciler(keys=keys))
    for node, reports in specs_by_node.items():
        g.register(node, reports, 10.0)
    return g


def test_an_ungranted_ready_claim_after_a_restart_is_never_routed_and_told_to_stop():
    f = Fleet("a", gpus=1)
    cat = catalog(replicas=1)
    (real,) = starts(f.step(cat, 0.0))
    # After a restart the impostor registers first, then the real agent.
    refused: list[str] = []
    g = Fleet("a", "b", gpus=1)
    g.rec.observe_register("b", [report(impostor_spec("b"), port=6666)], 10.0, refused)
    g.register("a", [report(real.spec)], 10.5)
    plan = g.step(cat, 11.0)
    assert [(s.node_id, s.shard_id) for s in stops(plan)] == [("b", "tiny.sim.0-beef/r0")]
    assert "refused: no grant" in stops(plan)[0].reason and refused
    (ep,) = endpoints(g.rec.book, g.nodes)
    assert ep["replica_id"] == real.spec["replica_id"] and ep["api_key"] == real.spec["api_key"]


def test_a_valid_grant_for_another_node_is_refused():
    f = Fleet("a", gpus=1)
    (real,) = starts(f.step(catalog(replicas=1), 0.0))
    g = restarted({"b": [report({**real.spec, "gpu_indices": [0]})]})
    (stop,) = stops(g.step(catalog(replicas=1), 11.0, in_grace=True))
    assert stop.node_id == "b" and "grant is for node 'a'" in stop.reason
    assert g.rec.book.replicas == {} and endpoints(g.rec.book, g.nodes) == []


def test_the_engine_key_comes_from_the_grant_never_from_the_report():
    f = Fleet("a", gpus=1)
    cat = catalog(replicas=1)
    (real,) = starts(f.step(cat, 0.0))
    g = restarted({"a": [report({**real.spec, "api_key": "x" * 43})]})
    g.step(cat, 11.0)
    (ep,) = endpoints(g.rec.book, g.nodes)
    assert ep["api_key"] == real.spec["api_key"] != "x" * 43
    # and a reconnect of the same agent cannot change it either
    g.register("a", [report({**real.spec, "api_key": "y" * 43})], 12.0)
    g.step(cat, 12.0)
    assert endpoints(g.rec.book, g.nodes)[0]["api_key"] == real.spec["api_key"]


def test_a_lost_secret_stops_every_engine_and_places_them_again():
    f = Fleet("a", gpus=1)
    cat = catalog(replicas=1)
    (real,) = starts(f.step(cat, 0.0))
    g = restarted({"a": [report(real.spec)]}, nodes=("a",), keys=GrantKeys.fresh())
    (stop,) = stops(g.step(cat, 11.0))
    assert "does not verify" in stop.reason and endpoints(g.rec.book, g.nodes) == []
    g.rec.observe_status("a", {"type": "shard_status", "shard_id": stop.shard_id, "state": "stopped"}, 12.0)
    (again,) = starts(g.step(cat, 12.0)) + starts(g.step(cat, 13.0))
    assert again.spec["replica_id"] != real.spec["replica_id"]
    assert verify(g.rec.keys, again.spec["grant"], Claim("a", again.spec["replica_id"], 0, 1, "tiny", "sim")).ok


def test_a_placed_replica_is_never_displaced_by_an_adopted_one():
    f = Fleet("a", "b", gpus=1)
    cat = catalog(replicas=1)
    (placed,) = starts(f.step(cat, 0.0))
    other = "b" if placed.node_id == "a" else "a"
    # A granted, Ready replica of the same slot shows up later (its node was away): it does not win the slot.
    late = granted(impostor_spec(other, "tiny.sim.0-cafe"), other)
    f.register(other, [report(late)], 5.0)
    plan = f.step(cat, 5.0)
    assert [s.shard_id for s in stops(plan)] == ["tiny.sim.0-cafe/r0"]
    kept = f.rec.book.replicas[placed.spec["replica_id"]]
    assert not kept.retired and kept.state is ReplicaState.STARTING
    make_ready(f, 6.0)
    f.step(cat, 6.0)
    assert [e["replica_id"] for e in endpoints(f.rec.book, f.nodes)] == [placed.spec["replica_id"]]


def test_state_dir_is_optional_and_must_name_a_directory():
    from llmgw.config import ConfigInvalid
    from llmgw.settings import parse_server_settings

    base = {"api": {"listen": {"port": 8443}}, "insecure_no_tls": True, "models": [], "profiles": [],
            "deployments": []}
    assert parse_server_settings(base).state_dir is None
    assert parse_server_settings({**base, "state_dir": "/var/lib/llmgw/cp"}).state_dir == "/var/lib/llmgw/cp"
    with pytest.raises(ConfigInvalid) as e:
        parse_server_settings({**base, "state_dir": "/var/lib/llmgw/cp/grant.key"})
    assert [err.pointer for err in e.value.errors] == ["/state_dir"]
