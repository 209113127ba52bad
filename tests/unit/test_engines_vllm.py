"""vLLM adapter: exact argv for single and multi-node shards, every owned flag refused."""

import pytest

from llmgw.catalog import Model, Profile
from llmgw.engines import (
    LaunchContext,
    LaunchContextError,
    ProfileError,
    build_launch,
    get_adapter,
    validate_profile,
)

HUB = Model(name="llama-8b", source="meta-llama/Llama-3.1-8B-Instruct", served_name="llama")


def ctx(**kw):
    base = dict(host="10.0.0.5", port=8001, model_path=HUB.source, gpu_indices=(0,))
    base.update(kw)
    return LaunchContext(**base)


def test_single_node_argv_is_exact():
    spec = build_launch(HUB, Profile("p", "vllm"), ctx())
    assert spec.argv == (
        "vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct",
        "--host", "10.0.0.5", "--port", "8001",
        "--served-model-name", "llama",
        "--tensor-parallel-size", "1", "--pipeline-parallel-size", "1",
    )
    assert spec.serves_http is True
    assert spec.port == 8001


def test_max_model_len_and_extra_args_follow_in_order():
    model = Model("m", "/models/m", "m", max_model_len=32768)
    profile = Profile("p", "vllm", tensor_parallel_size=2,
                      extra_args=("--gpu-memory-utilization", "0.85", "--enable-prefix-caching"))
    spec = build_launch(model, profile, ctx(model_path="/models/m", gpu_indices=(2, 3)))
    assert spec.argv == (
        "vllm", "serve", "/models/m",
        "--host", "10.0.0.5", "--port", "8001",
        "--served-model-name", "m",
        "--tensor-parallel-size", "2", "--pipeline-parallel-size", "1",
        "--max-model-len", "32768",
        "--gpu-memory-utilization", "0.85", "--enable-prefix-caching",
    )
    assert spec.env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "2,3"}


MULTI = Profile("tp8pp2", "vllm", tensor_parallel_size=8, pipeline_parallel_size=2, nodes=2)
GPUS = tuple(range(8))


def test_multi_node_rank0_serves_and_names_the_rendezvous():
    spec = build_launch(HUB, MULTI, ctx(rank=0, nnodes=2, master_addr="10.0.0.5",
                                        master_port=29600, gpu_indices=GPUS,
                                        extra_env={"NCCL_IB_HCA": "mlx5_0,mlx5_1"}))
    assert spec.argv == (
        "vllm", "serve", HUB.source,
        "--host", "10.0.0.5", "--port", "8001",
        "--served-model-name", "llama",
        "--tensor-parallel-size", "8", "--pipeline-parallel-size", "2",
        "--nnodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.5", "--master-port", "29600",
    )
    assert spec.serves_http and spec.port == 8001
    assert spec.env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "NCCL_IB_HCA": "mlx5_0,mlx5_1"}


def test_multi_node_worker_is_headless_without_an_endpoint():
    spec = build_launch(HUB, MULTI, ctx(rank=1, nnodes=2, master_addr="10.0.0.5",
                                        gpu_indices=GPUS))
    assert spec.argv == (
        "vllm", "serve", HUB.source,
        "--served-model-name", "llama",
        "--tensor-parallel-size", "8", "--pipeline-parallel-size", "2",
        "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.5",
        "--headless",
    )
    assert spec.serves_http is False
    assert spec.port is None


def test_command_override_replaces_only_the_binary():
    spec = build_launch(HUB, Profile("p", "vllm"), ctx(command=("llmgw-engine-sim",)))
    assert spec.argv[:3] == ("llmgw-engine-sim", "serve", HUB.source)
    spec = build_launch(HUB, Profile("p", "vllm"), ctx(command=("/opt/venv/bin/vllm",)))
    assert spec.argv[:2] == ("/opt/venv/bin/vllm", "serve")


OWNED = [
    ("--host", "0.0.0.0", "engine_bind_host"),
    ("--port", "9000", "engine_ports"),
    ("--uds", "/tmp/s", "TCP"),
    ("--model", "x", "source"),
    ("--served-model-name", "x", "served_name"),
    ("--tensor-parallel-size", "4", "tensor_parallel_size"),
    ("-tp", "4", "tensor_parallel_size"),
    ("--pipeline-parallel-size", "2", "pipeline_parallel_size"),
    ("-pp", "2", "pipeline_parallel_size"),
    ("--nnodes", "2", "nodes"),
    ("-n", "2", "nodes"),
    ("--node-rank", "1", "placement"),
    ("-r", "1", "placement"),
    ("--master-addr", "h", "placement"),
    ("--master-port", "1", "placement"),
    ("--data-parallel-size", "2", "replicas"),
    ("-dp", "2", "replicas"),
    ("--data-parallel-rank", "0", "replicas"),
    ("-dpn", "0", "replicas"),
    ("--data-parallel-start-rank", "0", "replicas"),
    ("-dpr", "0", "replicas"),
    ("--data-parallel-size-local", "1", "replicas"),
    ("-dpl", "1", "replicas"),
    ("--data-parallel-address", "h", "replicas"),
    ("-dpa", "h", "replicas"),
    ("--data-parallel-rpc-port", "1", "replicas"),
    ("-dpp", "1", "replicas"),
    ("--data-parallel-backend", "mp", "replicas"),
    ("-dpb", "mp", "replicas"),
    ("--config", "f.yaml", "list the flags"),
]


@pytest.mark.parametrize("flag,value,hint", OWNED)
@pytest.mark.parametrize("form", ["separate", "equals"])
def test_every_owned_flag_is_refused_in_both_forms(flag, value, hint, form):
    args = (flag, value) if form == "separate" else (f"{flag}={value}",)
    with pytest.raises(ProfileError) as e:
        validate_profile(Profile("p", "vllm", extra_args=args))
    assert len(e.value.problems) == 1
    problem = e.value.problems[0]
    assert flag in problem
    assert hint in problem
    assert "'p'" in str(e.value)


@pytest.mark.parametrize("flag", ["--headless", "--data-parallel-hybrid-lb", "--data-parallel-external-lb"])
def test_owned_switches_are_refused(flag):
    with pytest.raises(ProfileError) as e:
        validate_profile(Profile("p", "vllm", extra_args=(flag,)))
    assert flag in e.value.problems[0]


@pytest.mark.parametrize("token,canonical", [
    ("--tensor_parallel_size=2", "--tensor-parallel-size"),  # FlexibleArgumentParser underscores
    ("--served_model_name", "--served-model-name"),
    ("--por", "--port"),  # argparse abbreviation
    ("--served-model", "--served-model-name"),
    ("-n2", "--nnodes"),  # attached short value
    ("-tp=4", "--tensor-parallel-size"),
])
def test_alternative_spellings_are_caught(token, canonical):
    with pytest.raises(ProfileError) as e:
        validate_profile(Profile("p", "vllm", extra_args=(token, "1")))
    assert canonical in e.value.problems[0]
    assert repr(token) in e.value.problems[0]


def test_flags_that_merely_resemble_owned_ones_pass():
    validate_profile(Profile("p", "vllm", extra_args=(
        "--max-num-seqs", "128", "--hf-overrides", '{"x": 1}', "--seed", "-1",
        "--api-server-count", "2", "--distributed-executor-backend", "mp", "--model-impl", "auto",
    )))


def test_every_problem_is_listed_at_once():
    profile = Profile("p", "vllm", extra_args=("--port", "1", "-tp", "2"),
                      env=(("CUDA_VISIBLE_DEVICES", "0"),))
    with pytest.raises(ProfileError) as e:
        validate_profile(profile)
    assert len(e.value.problems) == 3
    assert "CUDA_VISIBLE_DEVICES" in e.value.problems[2]
    assert "3 problems" in str(e.value)


def test_max_model_len_is_owned_only_when_the_model_declares_it():
    profile = Profile("p", "vllm", extra_args=("--max-model-len", "4096"))
    build_launch(HUB, profile, ctx())  # the model declares none: the profile may set it
    declared = Model("m", HUB.source, "m", max_model_len=8192)
    with pytest.raises(ProfileError, match="max_model_len"):
        build_launch(declared, profile, ctx())


def test_executor_backend_is_owned_for_multi_node_only():
    args = ("--distributed-executor-backend", "ray")
    validate_profile(Profile("p", "vllm", tensor_parallel_size=2, extra_args=args))
    with pytest.raises(ProfileError, match="distributed-executor-backend"):
        validate_profile(Profile("p", "vllm", tensor_parallel_size=2, nodes=2, extra_args=args))


@pytest.mark.parametrize("tp,pp,nodes,needle", [
    (0, 1, 1, "tensor_parallel_size must be a positive integer"),
    (1, -1, 1, "pipeline_parallel_size must be a positive integer"),
    (3, 1, 2, "cannot be split evenly over nodes=2"),
])
def test_impossible_shapes_are_refused(tp, pp, nodes, needle):
    with pytest.raises(ProfileError, match=needle):
        validate_profile(Profile("p", "vllm", tensor_parallel_size=tp,
                                 pipeline_parallel_size=pp, nodes=nodes))


def test_a_profile_for_another_engine_is_refused_by_this_adapter():
    with pytest.raises(ProfileError, match="not 'vllm'"):
        get_adapter("vllm").validate_profile(Profile("p", "sglang"))


@pytest.mark.parametrize("kw,needle", [
    (dict(gpu_indices=(0, 1)), "needs 1 per node"),
    (dict(nnodes=2, master_addr="h"), "nodes=1"),
    (dict(gpu_indices=(1,), port=0), "not a TCP port"),
])
def test_context_contradicting_the_profile_is_a_context_error(kw, needle):
    with pytest.raises(LaunchContextError, match=needle):
        build_launch(HUB, Profile("p", "vllm"), ctx(**kw))


def test_multi_node_without_master_addr_is_a_context_error():
    with pytest.raises(LaunchContextError, match="master_addr"):
        build_launch(HUB, MULTI, ctx(rank=1, nnodes=2, gpu_indices=GPUS))


API_SERVER = ("/opt/vllm-cpu/bin/python", "-m", "vllm.entrypoints.openai.api_server")


def test_the_api_server_module_gets_the_model_as_an_option():
    """Its parser never reads a positional model (it would serve vLLM's default model instead)."""
    spec = build_launch(HUB, Profile("p", "vllm"), ctx(command=API_SERVER))
    assert spec.argv == (
        *API_SERVER, "--model", HUB.source,
        "--host", "10.0.0.5", "--port", "8001",
        "--served-model-name", "llama",
        "--tensor-parallel-size", "1", "--pipeline-parallel-size", "1",
    )


@pytest.mark.parametrize("command", [
    ("vllm",), ("/opt/venv/bin/vllm",), ("python", "-m", "vllm.entrypoints.cli.main"),
    ("llmgw-engine-sim",), ("python", "vllm.entrypoints.openai.api_server"),
])
def test_every_other_command_gets_serve_and_the_positional_model(command):
    spec = build_launch(HUB, Profile("p", "vllm"), ctx(command=command))
    assert spec.argv[len(command):len(command) + 2] == ("serve", HUB.source)
    assert "--model" not in spec.argv


def test_the_api_server_module_cannot_run_a_multi_node_shard():
    with pytest.raises(ProfileError, match="no headless worker mode.*vllm console script"):
        build_launch(HUB, MULTI, ctx(rank=1, nnodes=2, master_addr="10.0.0.5", gpu_indices=GPUS,
                                     command=API_SERVER))
