"""Semantic checks run beside schema errors, and every error points at the offending key."""

import copy

import pytest

from llmgw.catalog import Profile
from llmgw.config import ConfigInvalid
from llmgw.engines import ProfileError, validate_profile
from llmgw.settings import parse_agent_settings, parse_server_settings

SERVER = {
    "api": {"listen": {"port": 8443}},
    "insecure_no_tls": True,
    "models": [{"name": "m", "source": "Qwen/Qwen2.5-0.5B-Instruct"}],
    "profiles": [{"name": "p", "engine": "vllm", "tensor_parallel_size": 2}],
    "deployments": [{"model": "m", "profile": "p", "replicas": 1}],
}
AGENT = {"node_id": "n1", "control_plane": {"url": "wss://cp:8443"}, "state_dir": "/var/lib/llmgw",
         "tls": {"ca": "ca.crt", "cert": "n.crt", "key": "n.key"}}


def server_errors(doc):
    with pytest.raises(ConfigInvalid) as e:
        parse_server_settings(doc)
    return {(x.pointer, x.message) for x in e.value.errors}


def pointers(errors):
    return sorted(p for p, _ in errors)


def test_typo_key_and_broken_timing_invariant_are_both_reported():
    doc = copy.deepcopy(SERVER)
    doc["models"][0]["max_model_lenn"] = 4096
    doc["lifecycle"] = {"heartbeat_interval": 5, "keepalive_interval": 10, "unreachable_after": 12}
    errs = server_errors(doc)
    assert pointers(errs) == ["/lifecycle/unreachable_after", "/models/0/max_model_lenn"]
    assert any("keepalive_interval + heartbeat_interval" in m for _, m in errs)


def test_semantic_errors_of_several_sections_come_with_a_schema_error():
    doc = copy.deepcopy(SERVER)
    doc["api"]["listen"]["port"] = 70000
    doc["restart"] = {"backoff_initial": 10, "backoff_max": 5}
    doc["deployments"].append({"model": "ghost", "profile": "p", "replicas": 1})
    doc["profiles"][0]["extra_args"] = ["--port", "1"]
    assert pointers(server_errors(doc)) == [
        "/api/listen/port", "/deployments/1/model", "/profiles/0/extra_args/0", "/restart/backoff_max"]


def test_a_schema_invalid_value_gives_no_second_semantic_error():
    doc = copy.deepcopy(SERVER)
    # "30" is a string: the timing check must not compare it (or crash on it).
    doc["lifecycle"] = {"unreachable_after": "30", "lost_after": 10}
    doc["deployments"][0]["model"] = 7  # not a name: no "unknown model 7" on top
    del doc["insecure_no_tls"]
    doc["tls"] = {"ca": "ca.crt", "cert": "s.crt"}  # missing key: no "/tls required" on top
    errs = server_errors(doc)
    assert pointers(errs) == ["/deployments/0/model", "/lifecycle/unreachable_after", "/tls"]
    assert all("must exceed" not in m and "unknown model" not in m and "required unless" not in m
               for _, m in errs)


@pytest.mark.parametrize("mutate", [
    lambda d: d.update(lifecycle=[1, 2]),
    lambda d: d.update(restart="fast"),
    lambda d: d.update(models={"name": "m"}),
    lambda d: d.update(profiles=[None, "p", 3]),
    lambda d: d["profiles"][0].update(extra_args="--port 1", env=["A=1"]),
    lambda d: d["profiles"][0].update(name=None, engine=None, nodes="2"),
    lambda d: d.update(deployments=[{"model": [], "profile": {}}]),
    lambda d: d.pop("models"),
    lambda d: d.update(insecure_no_tls="no"),
])
def test_malformed_sections_are_schema_errors_never_a_crash(mutate):
    doc = copy.deepcopy(SERVER)
    mutate(doc)
    assert server_errors(doc)  # ConfigInvalid, not KeyError/TypeError


def test_non_mapping_documents_are_one_schema_error():
    for doc in (None, [], "x"):
        assert len(server_errors(doc)) == 1


def test_owned_flag_points_at_its_argv_element():
    doc = copy.deepcopy(SERVER)
    doc["profiles"][0]["extra_args"] = ["--max-num-seqs", "8", "-tp=4", "--enable-prefix-caching", "--por", "1"]
    errs = server_errors(doc)
    assert pointers(errs) == ["/profiles/0/extra_args/2", "/profiles/0/extra_args/4"]
    messages = dict(errs)
    assert "--tensor-parallel-size" in messages["/profiles/0/extra_args/2"]
    assert "--port" in messages["/profiles/0/extra_args/4"]


def test_env_problems_point_at_the_variable_escaped():
    doc = copy.deepcopy(SERVER)
    doc["profiles"][0]["env"] = {"9LIVES": "x", "a/b~c": "y", "OK_1": "z"}
    errs = server_errors(doc)
    assert pointers(errs) == ["/profiles/0/env/9LIVES", "/profiles/0/env/a~1b~0c"]
    assert all("does not match" in m for _, m in errs)
    doc["profiles"][0]["env"] = {"CUDA_VISIBLE_DEVICES": "0", "OK_1": "z"}
    (pointer, message), = server_errors(doc)
    assert pointer == "/profiles/0/env/CUDA_VISIBLE_DEVICES" and "placement picks" in message


def test_each_profile_problem_is_its_own_error_at_its_key():
    doc = copy.deepcopy(SERVER)
    doc["profiles"].append({"name": "l", "engine": "llamacpp", "nodes": 2,
                            "pipeline_parallel_size": 2, "env": {"LLAMA_ARG_PORT": "1"}})
    doc["profiles"].append({"name": "u", "engine": "vllm", "tensor_parallel_size": 3, "nodes": 2})
    assert pointers(server_errors(doc)) == [
        "/profiles/1/env/LLAMA_ARG_PORT", "/profiles/1/nodes", "/profiles/1/pipeline_parallel_size",
        "/profiles/2/nodes"]


def test_a_broken_profile_does_not_hide_another_profiles_problem():
    doc = copy.deepcopy(SERVER)
    doc["profiles"].append({"name": "q", "engine": "vllm", "extra_args": ["-pp", "2"], "env": {"1X": "y"}})
    doc["profiles"][0]["extra_args"] = ["--host", "h"]
    # /profiles/1 is schema-invalid (env name), so only its schema error; /profiles/0 still checked.
    assert pointers(server_errors(doc)) == ["/profiles/0/extra_args/0", "/profiles/1/env/1X"]


def test_profile_error_paths_follow_the_problems():
    profile = Profile("p", "vllm", extra_args=("--seed", "1", "--port", "2", 5),
                      env=(("CUDA_VISIBLE_DEVICES", "0"),))
    with pytest.raises(ProfileError) as e:
        validate_profile(profile)
    assert e.value.paths == ("extra_args/4", "extra_args/2", "env/CUDA_VISIBLE_DEVICES")
    assert ProfileError("plain").paths == ("",)


def test_agent_typo_key_and_plaintext_url_are_both_reported():
    doc = copy.deepcopy(AGENT)
    doc["control_plane"]["url"] = "ws://cp:8443"
    doc["state_dirr"] = "/tmp"
    doc["fetch"] = {"backoff_initial": 10, "backoff_max": 1}
    with pytest.raises(ConfigInvalid) as e:
        parse_agent_settings(doc)
    assert [x.pointer for x in e.value.errors] == ["/control_plane/url", "/fetch/backoff_max", "/state_dirr"]


def test_agent_missing_url_is_one_error_not_a_crash():
    doc = copy.deepcopy(AGENT)
    del doc["control_plane"]["url"]
    with pytest.raises(ConfigInvalid) as e:
        parse_agent_settings(doc)
    assert [(x.pointer, x.message) for x in e.value.errors] == [
        ("/control_plane", "'url' is a required property")]
