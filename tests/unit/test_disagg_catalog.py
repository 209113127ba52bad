"""A disaggregated deployment: two groups of derived profiles in the catalog, refused at its JSON pointer."""

from __future__ import annotations

import copy

import pytest

from llmgw.catalog import KVTransfer
from llmgw.config import ConfigInvalid
from llmgw.controlplane.replicas import profile_to_dict
from llmgw.agent.shard import spec_profile
from llmgw.settings import parse_server_settings

SERVER = {
    "api": {"listen": {"port": 8443}},
    "insecure_no_tls": True,
    "models": [{"name": "m", "source": "Qwen/Qwen2.5-0.5B-Instruct"}],
    "profiles": [{"name": "p", "engine": "vllm", "tensor_parallel_size": 4, "env": {"UCX_TLS": "rc,cuda_copy"}},
                 {"name": "l", "engine": "llamacpp"}, {"name": "wide", "engine": "vllm", "nodes": 2,
                                                       "tensor_parallel_size": 2}],
    "deployments": [{"model": "m", "profile": "p",
                     "disaggregation": {"prefill": {"replicas": 4, "tensor_parallel_size": 1},
                                        "decode": {"replicas": 1}}}],
}


def errors(doc) -> dict[str, str]:
    with pytest.raises(ConfigInvalid) as e:
        parse_server_settings(doc)
    return {x.pointer: x.message for x in e.value.errors}


def test_groups_become_deployments_of_derived_profiles():
    cat = parse_server_settings(SERVER).catalog
    assert [(d.profile, d.replicas, d.role) for d in cat.deployments] == [("p:prefill", 4, "prefill"),
                                                                          ("p:decode", 1, "decode")]
    pre, dec = cat.profiles["p:prefill"], cat.profiles["p:decode"]
    assert (pre.tensor_parallel_size, dec.tensor_parallel_size) == (1, 4)  # the group's, else the profile's
    assert pre.kv_transfer == KVTransfer("nixl", "prefill") and dec.kv_transfer == KVTransfer("nixl", "decode")
    assert pre.env_dict == {"UCX_TLS": "rc,cuda_copy"}  # the operator's transport choice travels
    assert cat.profiles["p"].kv_transfer is None


def test_the_role_reaches_the_agent_and_back():
    pre = parse_server_settings(SERVER).catalog.profiles["p:prefill"]
    assert spec_profile({"profile": profile_to_dict(pre)}) == pre
    plain = parse_server_settings(SERVER).catalog.profiles["p"]
    assert "kv_transfer" not in profile_to_dict(plain)  # an agent that predates it would refuse the key


@pytest.mark.parametrize("change, pointer, words", [
    (lambda d: d.update(profile="l"), "/deployments/0/disaggregation", "llamacpp"),
    (lambda d: d.update(profile="wide"), "/deployments/0/disaggregation", "spans 2 nodes"),
    (lambda d: d.update(replicas=2), "/deployments/0/replicas", "per group"),
    (lambda d: d.update(autoscale={"max": 3}), "/deployments/0/autoscale", "fixed count"),
    (lambda d: d.pop("disaggregation"), "/deployments/0", "needs replicas"),
    (lambda d: d["disaggregation"].update(connector="mooncake"), "/deployments/0/disaggregation/connector", ""),
    (lambda d: d["disaggregation"]["decode"].update(replicas=0), "/deployments/0/disaggregation/decode/replicas", ""),
    (lambda d: d["disaggregation"].pop("prefill"), "/deployments/0/disaggregation", "prefill"),
])
def test_refused_at_its_pointer(change, pointer, words):
    doc = copy.deepcopy(SERVER)
    change(doc["deployments"][0])
    got = errors(doc)
    assert pointer in got, got
    assert words in got[pointer]


def test_a_derived_profile_names_replicas_the_agent_accepts():
    import json
    import re
    from importlib import resources

    from llmgw.controlplane.replicas import new_replica_id, shard_id

    ids = json.loads((resources.files("llmgw") / "schemas" / "stream.schema.json").read_text())["$defs"]["id"]
    names = json.loads((resources.files("llmgw") / "schemas" / "server.schema.json").read_text())["$defs"]["name"]
    for profile in parse_server_settings(SERVER).catalog.profiles:
        rid = new_replica_id("m", profile, 0)
        assert re.fullmatch(ids["pattern"], rid) and re.fullmatch(ids["pattern"], shard_id(rid, 0)), rid
        assert (re.fullmatch(names["pattern"], profile) is None) == (":" in profile)  # never a declared name
