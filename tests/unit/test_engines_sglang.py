"""SGLang adapter: exact argv, multi-node rendezvous, both spellings of owned flags refused."""

import pytest

from llmgw.catalog import Model, Profile
from llmgw.engines import LaunchContext, LaunchContextError, ProfileError, build_launch, validate_profile

MODEL = Model(name="qwen", source="Qwen/Qwen2.5-7B-Instruct", served_name="qwen-7b")


def ctx(**kw):
    base = dict(host="127.0.0.1", port=30001, model_path=MODEL.source, gpu_indices=(4,))
    base.update(kw)
    return LaunchContext(**base)


def test_single_node_argv_is_exact():
    spec = build_launch(MODEL, Profile("s", "sglang"), ctx())
    assert spec.argv == (
        "python", "-m", "sglang.launch_server",
        "--model-path", "Qwen/Qwen2.5-7B-Instruct",
        "--host", "127.0.0.1", "--port", "30001",
        "--served-model-name", "qwen-7b",
        "--tp-size", "1", "--enable-metrics",
    )
    assert spec.env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "4"}
    assert spec.serves_http and spec.port == 30001


def test_pipeline_and_context_length_and_extra_args():
    model = Model("qwen", "/w/qwen", "qwen", max_model_len=16384)
    profile = Profile("s", "sglang", tensor_parallel_size=2, pipeline_parallel_size=2,
                      extra_args=("--mem-fraction-static", "0.8"))
    spec = build_launch(model, profile, ctx(model_path="/w/qwen", gpu_indices=(0, 1, 2, 3)))
    assert spec.argv == (
        "python", "-m", "sglang.launch_server",
        "--model-path", "/w/qwen", "--host", "127.0.0.1", "--port", "30001",
        "--served-model-name", "qwen", "--tp-size", "2", "--enable-metrics", "--pp-size", "2",
        "--context-length", "16384",
        "--mem-fraction-static", "0.8",
    )


@pytest.mark.parametrize("rank,serves", [(0, True), (1, False)])
def test_multi_node_ranks(rank, serves):
    profile = Profile("s", "sglang", tensor_parallel_size=16, nodes=2)
    spec = build_launch(MODEL, profile, ctx(rank=rank, nnodes=2, master_addr="10.1.0.1",
                                            master_port=25000, gpu_indices=tuple(range(8))))
    assert spec.argv == (
        "python", "-m", "sglang.launch_server",
        "--model-path", MODEL.source, "--host", "127.0.0.1", "--port", "30001",
        "--served-model-name", "qwen-7b", "--tp-size", "16", "--enable-metrics",
        "--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr", "10.1.0.1:25000",
    )
    assert spec.serves_http is serves
    assert spec.port == (30001 if serves else None)


def test_multi_node_needs_a_rendezvous_port():
    profile = Profile("s", "sglang", tensor_parallel_size=2, nodes=2)
    with pytest.raises(LaunchContextError, match="master_port"):
        build_launch(MODEL, profile, ctx(nnodes=2, master_addr="h", gpu_indices=(0,)))


def test_command_override_replaces_python_m():
    spec = build_launch(MODEL, Profile("s", "sglang"), ctx(command=("llmgw-engine-sim", "sglang")))
    assert spec.argv[:4] == ("llmgw-engine-sim", "sglang", "--model-path", MODEL.source)


OWNED = [
    ("--model-path", "x"), ("--model", "x"), ("--host", "h"), ("--port", "1"),
    ("--served-model-name", "x"), ("--tp-size", "2"), ("--tensor-parallel-size", "2"),
    ("--pp-size", "2"), ("--pipeline-parallel-size", "2"), ("--dp-size", "2"),
    ("--data-parallel-size", "2"), ("--nnodes", "2"), ("--node-rank", "1"),
    ("--dist-init-addr", "h:1"), ("--nccl-init-addr", "h:1"), ("--base-gpu-id", "1"),
    ("--gpu-id-step", "2"), ("--config", "c.yaml"),
]


@pytest.mark.parametrize("flag,value", OWNED)
@pytest.mark.parametrize("form", ["separate", "equals"])
def test_every_owned_flag_is_refused_in_both_forms(flag, value, form):
    args = (flag, value) if form == "separate" else (f"{flag}={value}",)
    with pytest.raises(ProfileError) as e:
        validate_profile(Profile("s", "sglang", extra_args=args))
    assert len(e.value.problems) == 1
    assert flag in e.value.problems[0]


def test_grpc_mode_is_refused():
    with pytest.raises(ProfileError, match="--grpc-mode"):
        validate_profile(Profile("s", "sglang", extra_args=("--grpc-mode",)))


def test_abbreviation_of_an_owned_flag_is_caught():
    with pytest.raises(ProfileError, match="--tp-size"):
        validate_profile(Profile("s", "sglang", extra_args=("--tp", "2")))


def test_context_length_is_owned_when_the_model_declares_it():
    declared = Model("m", "/w/m", "m", max_model_len=4096)
    profile = Profile("s", "sglang", extra_args=("--context-length", "2048"))
    build_launch(MODEL, profile, ctx())
    with pytest.raises(ProfileError, match="max_model_len"):
        build_launch(declared, profile, ctx(model_path="/w/m"))


def test_unrelated_flags_pass():
    validate_profile(Profile("s", "sglang", extra_args=(
        "--mem-fraction-static", "0.8", "--enable-metrics", "--chunked-prefill-size", "-1",
        "--attention-backend", "fa3",
    )))
