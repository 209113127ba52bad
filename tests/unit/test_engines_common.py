"""What all adapters share: the engine registry, sources, and the launch environment."""

import os

import pytest

from llmgw.catalog import Model, Profile
from llmgw.engines import (
    ENGINES,
    LaunchContext,
    ProfileError,
    SourceError,
    build_launch,
    get_adapter,
    resolve_model_path,
)


def test_registry_names_every_engine_and_refuses_unknown_ones():
    assert set(ENGINES) == {"vllm", "sglang", "llamacpp"}
    assert get_adapter("sglang").name == "sglang"
    with pytest.raises(ProfileError, match="unknown engine 'trtllm'.*llamacpp, sglang, vllm"):
        get_adapter("trtllm")


def test_hub_id_is_passed_untouched():
    assert resolve_model_path(Model("q", "Qwen/Qwen2.5-7B-Instruct", "q")) == "Qwen/Qwen2.5-7B-Instruct"


def test_absolute_path_must_exist(tmp_path):
    weights = tmp_path / "w"
    weights.mkdir()
    assert resolve_model_path(Model("m", str(weights), "m")) == str(weights)
    missing = tmp_path / "gone"
    with pytest.raises(SourceError, match=f"model path {missing} does not exist"):
        resolve_model_path(Model("m", str(missing), "m"))


def test_relative_path_resolves_against_the_model_dir(tmp_path):
    (tmp_path / "llama").mkdir()
    model = Model("m", "./llama", "m")
    assert resolve_model_path(model, model_dir=str(tmp_path)) == str(tmp_path / "llama")
    with pytest.raises(SourceError, match="does not exist.*'./nope' resolved against"):
        resolve_model_path(Model("m", "./nope", "m"), model_dir=str(tmp_path))


def test_relative_path_without_model_dir_uses_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path(Model("m", "./x.gguf", "m")) == os.path.join(str(tmp_path), "x.gguf")


def test_url_source_is_the_fetchers_job():
    with pytest.raises(SourceError, match="weight fetcher"):
        resolve_model_path(Model("m", "https://example.org/m.gguf", "m"))


def test_source_error_is_a_profile_error():
    assert issubclass(SourceError, ProfileError)


MODEL = Model("m", "org/m", "m")


def test_env_joins_gpus_then_profile_env_then_placement():
    profile = Profile("p", "vllm", tensor_parallel_size=2,
                      env=(("NCCL_DEBUG", "INFO"), ("VLLM_LOGGING_LEVEL", "DEBUG")))
    spec = build_launch(MODEL, profile, LaunchContext(
        host="h", port=1, model_path="org/m", gpu_indices=(6, 7),
        extra_env={"NCCL_IB_HCA": "mlx5_2"}))
    assert spec.env == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "6,7", "NCCL_DEBUG": "INFO",
        "VLLM_LOGGING_LEVEL": "DEBUG", "NCCL_IB_HCA": "mlx5_2",
    }


def test_no_gpu_indices_leaves_cuda_visible_devices_unset():
    spec = build_launch(MODEL, Profile("p", "vllm"), LaunchContext(host="h", port=1, model_path="org/m"))
    assert "CUDA_VISIBLE_DEVICES" not in spec.env and "CUDA_DEVICE_ORDER" not in spec.env


def test_profile_env_contradicting_placement_is_refused():
    profile = Profile("p", "vllm", env=(("NCCL_IB_HCA", "mlx5_9"),))
    with pytest.raises(ProfileError, match="NCCL_IB_HCA='mlx5_9' but placement sets NCCL_IB_HCA='mlx5_0'"):
        build_launch(MODEL, profile, LaunchContext(host="h", port=1, model_path="org/m",
                                                   extra_env={"NCCL_IB_HCA": "mlx5_0"}))


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("key", ["CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"])
def test_gpu_numbering_in_profile_env_is_refused_by_every_engine(engine, key):
    """Placement's GPU numbers are NVML's (PCI bus order): a profile may not renumber them."""
    with pytest.raises(ProfileError, match=key):
        get_adapter(engine).validate_profile(Profile("p", engine, env=((key, "0"),)))


def test_non_string_extra_args_are_refused():
    with pytest.raises(ProfileError, match=r"extra_args\[1\] must be a string, got int"):
        get_adapter("vllm").validate_profile(Profile("p", "vllm", extra_args=("--seed", 3)))
