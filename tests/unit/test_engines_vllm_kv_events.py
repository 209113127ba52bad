"""A profile's ``kv_events``: the vLLM adapter configures the KV event publisher itself.

What it emits (an ``ipc://`` publisher and replay socket in the shard's socket directory, a
topic naming the shard), where it refuses (other engines, prefix caching turned off, a socket
path longer than a unix socket address holds), and that a hand-written ``--kv-events-config``
stays refused with the setting on.
"""

import copy
import json
import os

import pytest

from llmgw.agent.shard import spec_profile
from llmgw.agent.statedir import StateDir, socket_dir
from llmgw.catalog import Catalog, Model, Profile
from llmgw.config import ConfigInvalid
from llmgw.controlplane.replicas import profile_to_dict, spec_matches
from llmgw.engines import LaunchContext, LaunchContextError, ProfileError, build_launch, validate_profile
from llmgw.engines.vllm import SUN_PATH_MAX, kv_events_endpoints
from llmgw.settings import parse_server_settings

MODEL = Model("tiny", "/models/tiny", "tiny")
KV = Profile("kv", "vllm", kv_events=True)
SHARD = "tiny.kv.0-a1b2c3/r0"


def ctx(**kw):
    base = dict(host="127.0.0.1", port=8001, model_path=MODEL.source, shard_id=SHARD, socket_dir="/var/lib/llmgw/kv/0123456789ab")
    base.update(kw)
    return LaunchContext(**base)


def flag(argv, name):
    return argv[argv.index(name) + 1]


def test_kv_events_emit_prefix_caching_and_an_ipc_publisher_in_the_shards_socket_dir():
    argv = build_launch(MODEL, KV, ctx()).argv
    assert "--enable-prefix-caching" in argv
    config = json.loads(flag(argv, "--kv-events-config"))
    assert config == {"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": "ipc:///var/lib/llmgw/kv/0123456789ab/ev",
                      "replay_endpoint": "ipc:///var/lib/llmgw/kv/0123456789ab/replay",
                      "topic": f"kv@{SHARD}"}
    assert kv_events_endpoints("/var/lib/llmgw/kv/0123456789ab") == (config["endpoint"], config["replay_endpoint"])


def test_without_kv_events_nothing_is_published():
    argv = build_launch(MODEL, Profile("p", "vllm"), ctx()).argv
    assert "--kv-events-config" not in argv and "--enable-prefix-caching" not in argv
    assert "--enable-prompt-tokens-details" not in argv


def test_kv_events_ask_the_engine_to_report_its_cached_prompt_tokens_unless_extra_args_decide():
    """The router's cache-hit predictions are checked against the engine's own count
    (usage.prompt_tokens_details.cached_tokens), which vLLM reports only with the flag."""
    assert build_launch(MODEL, KV, ctx()).argv.count("--enable-prompt-tokens-details") == 1
    for given in (["--no-enable-prompt-tokens-details"], ["--enable-prompt-tokens-details"],
                  ["--enable_prompt_tokens_details=false"]):
        argv = build_launch(MODEL, Profile("kv", "vllm", kv_events=True, extra_args=tuple(given)), ctx()).argv
        assert argv.count("--enable-prompt-tokens-details") == (1 if given[0] == "--enable-prompt-tokens-details" else 0)
        assert list(argv[-len(given):]) == given


def test_only_rank_0_publishes():
    multi = Profile("mn", "vllm", tensor_parallel_size=2, nodes=2, kv_events=True)
    rank1 = build_launch(MODEL, multi, ctx(rank=1, nnodes=2, master_addr="10.0.0.1", gpu_indices=(0,))).argv
    rank0 = build_launch(MODEL, multi, ctx(rank=0, nnodes=2, master_addr="10.0.0.1", gpu_indices=(0,))).argv
    assert "--kv-events-config" not in rank1 and "--kv-events-config" in rank0
    assert "--enable-prompt-tokens-details" not in rank1 and "--enable-prompt-tokens-details" in rank0


def test_no_socket_dir_or_a_path_past_the_unix_socket_limit_is_refused_before_launch():
    with pytest.raises(LaunchContextError, match="socket_dir"):
        build_launch(MODEL, KV, ctx(socket_dir=None))
    longest = "/" + "d" * (SUN_PATH_MAX - len("/replay") - 1)
    build_launch(MODEL, KV, ctx(socket_dir=longest))  # 107 bytes: fits
    with pytest.raises(LaunchContextError, match=r"108 bytes, more than the 107 .* shorter state_dir"):
        build_launch(MODEL, KV, ctx(socket_dir=longest + "d"))


def test_the_agent_gives_each_shard_a_short_private_socket_dir(tmp_path):
    store = StateDir(tmp_path / "state")
    long_id = "a-model-with-a-very-long-name-indeed.and-a-long-profile-name-too.0-a1b2c3/r0"
    d = socket_dir(store.root, long_id)
    assert d.parent == store.root / "kv" and len(d.name) == 12
    assert os.stat(d).st_mode & 0o777 == 0o700 and os.stat(d.parent).st_mode & 0o777 == 0o700
    assert socket_dir(store.root, long_id) == d and socket_dir(store.root, long_id + "x") != d
    assert len(str(d)) == len(str(store.root)) + len("/kv/0123456789ab")


def test_a_shard_that_ends_leaves_no_socket_behind(tmp_path):
    """An engine killed outright leaves its bound sockets; the shard's end removes them with its keys."""
    import socket

    store = StateDir(tmp_path / "state")
    d = socket_dir(store.root, SHARD)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(d / "ev"))
    (d / "replay").write_bytes(b"")
    other = socket_dir(store.root, SHARD + "x")
    store.remove_secrets(SHARD)
    assert not d.exists() and other.is_dir()
    store.remove_secrets(SHARD)  # nothing left: no error


def test_a_hand_written_kv_events_config_stays_refused_with_the_setting_on():
    with pytest.raises(ProfileError) as e:
        validate_profile(Profile("kv", "vllm", kv_events=True,
                                 extra_args=("--kv-events-config", '{"endpoint":"tcp://*:5557"}')))
    assert e.value.paths == ("extra_args/0",) and "reserved for llmgw" in e.value.problems[0]


@pytest.mark.parametrize("token", ["--no-enable-prefix-caching", "--no_enable_prefix_caching", "--no-enable-prefix"])
def test_prefix_caching_turned_off_contradicts_kv_events(token):
    with pytest.raises(ProfileError) as e:
        validate_profile(Profile("kv", "vllm", kv_events=True, extra_args=("--max-num-seqs", "4", token)))
    assert e.value.paths == ("extra_args/2",) and "prefix cache" in e.value.problems[0]
    validate_profile(Profile("p", "vllm", extra_args=(token,)))  # without kv_events it is the profile's


SERVER = {
    "api": {"listen": {"port": 8443}},
    "insecure_no_tls": True,
    "models": [{"name": "m", "source": "Qwen/Qwen2.5-0.5B-Instruct"}],
    "profiles": [{"name": "p", "engine": "vllm"}],
    "deployments": [{"model": "m", "profile": "p", "replicas": 1}],
}


def server(**profile):
    doc = copy.deepcopy(SERVER)
    doc["profiles"][0].update(profile)
    return doc


@pytest.mark.parametrize("engine", ["sglang", "llamacpp"])
def test_config_refuses_kv_events_for_other_engines_at_the_key(engine):
    with pytest.raises(ConfigInvalid) as e:
        parse_server_settings(server(engine=engine, kv_events=True))
    errs = {x.pointer: x.message for x in e.value.errors}
    assert list(errs) == ["/profiles/0/kv_events"] and "only vllm" in errs["/profiles/0/kv_events"]


def test_config_points_at_the_switch_that_turns_prefix_caching_off():
    with pytest.raises(ConfigInvalid) as e:
        parse_server_settings(server(kv_events=True, extra_args=["--no-enable-prefix-caching"]))
    assert [x.pointer for x in e.value.errors] == ["/profiles/0/extra_args/0"]
    with pytest.raises(ConfigInvalid) as e:
        parse_server_settings(server(kv_events="yes"))
    assert [x.pointer for x in e.value.errors] == ["/profiles/0/kv_events"]


def test_the_setting_reaches_the_agent_and_a_change_replaces_the_replica():
    parse_server_settings(server(kv_events=True))
    on = Catalog.from_config(server(kv_events=True)).profiles["p"]
    off = Catalog.from_config(server()).profiles["p"]
    assert on.kv_events and not off.kv_events
    assert "kv_events" not in profile_to_dict(off)  # an agent that predates the key never sees it
    spec_on = {"model": {"name": "m", "source": "Qwen/Qwen2.5-0.5B-Instruct", "served_name": "m"},
               "profile": profile_to_dict(on)}
    spec_off = {**spec_on, "profile": profile_to_dict(off)}
    assert spec_profile(spec_on).kv_events and not spec_profile(spec_off).kv_events
    model = Catalog.from_config(server()).models["m"]
    assert spec_matches(spec_on, model, on) and spec_matches(spec_off, model, off)
    assert not spec_matches(spec_on, model, off) and not spec_matches(spec_off, model, on)


def test_an_agent_accepts_a_start_whose_profile_has_kv_events():
    from stream_messages import SPEC

    from llmgw.agent.stream import incoming_problems

    spec = {**SPEC, "profile": {**SPEC["profile"], "kv_events": True}}
    assert incoming_problems({"type": "start", "spec": spec}) == []
    bad = {**SPEC, "profile": {**SPEC["profile"], "kv_events": 1}}
    assert incoming_problems({"type": "start", "spec": bad})
