"""One side of a prefill/decode pair: the vLLM adapter's owned --kv-transfer-config, side channel and UCX env."""

from __future__ import annotations

import json

import pytest

from llmgw.catalog import KVTransfer, Model, Profile
from llmgw.engines import LaunchContext, LaunchContextError, ProfileError, build_launch, validate_profile

MODEL = Model("tiny", "/models/tiny", "tiny")
PREFILL = Profile("p:prefill", "vllm", kv_transfer=KVTransfer("nixl", "prefill"))
DECODE = Profile("p:decode", "vllm", tensor_parallel_size=2, kv_transfer=KVTransfer("nixl", "decode"))


def ctx(**kw):
    base = dict(host="0.0.0.0", port=8001, model_path=MODEL.source, gpu_indices=(0,),
                kv_side_channel=("10.1.0.7", 20417))
    base.update(kw)
    return LaunchContext(**base)


def flag(argv, name):
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("profile, gpus, role", [(PREFILL, (0,), "kv_producer"), (DECODE, (2, 3), "kv_consumer")])
def test_each_role_gets_its_connector_role_and_side_channel(profile, gpus, role):
    spec = build_launch(MODEL, profile, ctx(gpu_indices=gpus))
    assert json.loads(flag(spec.argv, "--kv-transfer-config")) == {"kv_connector": "NixlConnector", "kv_role": role}
    assert spec.argv.count("--kv-transfer-config") == 1
    assert spec.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.1.0.7"
    assert spec.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "20417"


def test_a_cpu_shard_keeps_its_kv_buffer_in_host_memory():
    spec = build_launch(MODEL, PREFILL, ctx(gpu_indices=()))
    assert json.loads(flag(spec.argv, "--kv-transfer-config"))["kv_buffer_device"] == "cpu"


def test_a_plain_profile_gets_no_connector():
    spec = build_launch(MODEL, Profile("p", "vllm"), ctx(kv_side_channel=None))
    assert "--kv-transfer-config" not in spec.argv
    assert not any(k.startswith("VLLM_NIXL") for k in spec.env)


def test_ucx_devices_come_from_placement_and_the_transports_from_the_operator():
    prof = Profile("p:decode", "vllm", env=(("UCX_TLS", "rc,cuda_copy,cuda_ipc"),),
                   kv_transfer=KVTransfer("nixl", "decode"))
    spec = build_launch(MODEL, prof, ctx(extra_env={"UCX_NET_DEVICES": "mlx5_0:1"}))
    assert spec.env["UCX_NET_DEVICES"] == "mlx5_0:1" and spec.env["UCX_TLS"] == "rc,cuda_copy,cuda_ipc"
    clash = Profile("p:decode", "vllm", env=(("UCX_NET_DEVICES", "mlx5_3:1"),),
                    kv_transfer=KVTransfer("nixl", "decode"))
    with pytest.raises(ProfileError) as e:
        build_launch(MODEL, clash, ctx(extra_env={"UCX_NET_DEVICES": "mlx5_0:1"}))
    assert e.value.paths == ("env/UCX_NET_DEVICES",)


def test_the_side_channel_and_the_connector_are_owned():
    env = Profile("p", "vllm", env=(("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600"),))
    with pytest.raises(ProfileError) as e:
        validate_profile(env)
    assert e.value.paths == ("env/VLLM_NIXL_SIDE_CHANNEL_PORT",)
    dotted = Profile("p:prefill", "vllm", extra_args=("--kv-transfer-config.kv_role", "kv_both"),
                     kv_transfer=KVTransfer("nixl", "prefill"))
    with pytest.raises(ProfileError) as e:
        validate_profile(dotted)
    assert e.value.paths == ("extra_args/0",)


def test_llamacpp_refuses_to_be_one_side_of_a_pair():
    with pytest.raises(ProfileError) as e:
        validate_profile(Profile("p:prefill", "llamacpp", kv_transfer=KVTransfer("nixl", "prefill")))
    assert "kv_transfer" in e.value.paths


def test_a_launch_without_its_side_channel_is_the_callers_bug():
    with pytest.raises(LaunchContextError, match="side channel"):
        build_launch(MODEL, PREFILL, ctx(kv_side_channel=None))
