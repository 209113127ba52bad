"""One side of a prefill/decode pair on SGLang: its --disaggregation-* flags, bootstrap port and host address."""

from __future__ import annotations

import pytest

from llmgw.catalog import KVTransfer, Model, Profile
from llmgw.engines import LaunchContext, LaunchContextError, ProfileError, build_launch, validate_profile

MODEL = Model("tiny", "/models/tiny", "tiny")
PREFILL = Profile("p:prefill", "sglang", kv_transfer=KVTransfer("nixl", "prefill"))
DECODE = Profile("p:decode", "sglang", tensor_parallel_size=2, kv_transfer=KVTransfer("nixl", "decode"))


def ctx(**kw):
    base = dict(host="0.0.0.0", port=8001, model_path=MODEL.source, gpu_indices=(0,),
                kv_side_channel=("10.1.0.7", 20417))
    base.update(kw)
    return LaunchContext(**base)


def flag(argv, name):
    assert argv.count(name) == 1, argv
    return argv[argv.index(name) + 1]


def test_a_prefill_replica_serves_its_bootstrap_on_the_allocated_port():
    spec = build_launch(MODEL, PREFILL, ctx())
    assert flag(spec.argv, "--disaggregation-mode") == "prefill"
    assert flag(spec.argv, "--disaggregation-transfer-backend") == "nixl"
    assert flag(spec.argv, "--disaggregation-bootstrap-port") == "20417"
    assert spec.env["SGLANG_HOST_IP"] == "10.1.0.7"
    assert "--disaggregation-ib-device" not in spec.argv  # UCX_NET_DEVICES takes precedence for NIXL


def test_a_decode_replica_names_its_mode_and_binds_the_nodes_address():
    spec = build_launch(MODEL, DECODE, ctx(gpu_indices=(2, 3)))
    assert flag(spec.argv, "--disaggregation-mode") == "decode"
    assert flag(spec.argv, "--disaggregation-transfer-backend") == "nixl"
    assert "--disaggregation-bootstrap-port" not in spec.argv  # only a prefill server runs one
    assert spec.env["SGLANG_HOST_IP"] == "10.1.0.7"
    assert flag(spec.argv, "--tp-size") == "2"


def test_ucx_devices_come_from_placement():
    spec = build_launch(MODEL, DECODE, ctx(gpu_indices=(2, 3), extra_env={"UCX_NET_DEVICES": "mlx5_0:1"}))
    assert spec.env["UCX_NET_DEVICES"] == "mlx5_0:1"


def test_a_plain_profile_gets_no_disaggregation():
    spec = build_launch(MODEL, Profile("p", "sglang"), ctx(kv_side_channel=None))
    assert not any(a.startswith("--disaggregation") for a in spec.argv)
    assert "SGLANG_HOST_IP" not in spec.env


@pytest.mark.parametrize("args, path", [
    (("--disaggregation-mode", "decode"), "extra_args/0"),
    (("--disaggregation-bootstrap-port=9000",), "extra_args/0"),
    (("--disaggregation-transfer-backend", "mooncake"), "extra_args/0"),
])
def test_the_flags_a_pair_needs_are_owned(args, path):
    with pytest.raises(ProfileError) as e:
        validate_profile(Profile("p:prefill", "sglang", extra_args=args, kv_transfer=KVTransfer("nixl", "prefill")))
    assert e.value.paths == (path,)


def test_the_host_address_is_owned_and_never_inherited():
    with pytest.raises(ProfileError) as e:
        validate_profile(Profile("p", "sglang", env=(("SGLANG_HOST_IP", "10.9.9.9"),)))
    assert e.value.paths == ("env/SGLANG_HOST_IP",)
    assert "SGLANG_HOST_IP" in build_launch(MODEL, PREFILL, ctx()).owned_env


def test_the_decode_side_tuning_stays_the_profiles():
    prof = Profile("p:decode", "sglang", extra_args=("--disaggregation-decode-polling-interval", "4"),
                   kv_transfer=KVTransfer("nixl", "decode"))
    assert flag(build_launch(MODEL, prof, ctx()).argv, "--disaggregation-decode-polling-interval") == "4"


def test_a_launch_without_its_side_channel_is_the_callers_bug():
    with pytest.raises(LaunchContextError, match="side channel"):
        build_launch(MODEL, PREFILL, ctx(kv_side_channel=None))
