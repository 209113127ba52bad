"""llama.cpp adapter: GGUF files only, one node, no pipeline parallelism, owned flags refused."""

import pytest

from llmgw.catalog import Model, Profile
from llmgw.engines import (
    LaunchContext,
    LaunchContextError,
    ProfileError,
    SourceError,
    build_launch,
    validate,
    validate_profile,
)

GGUF = Model(name="phi", source="/models/phi-3-mini-q4.gguf", served_name="phi3")


def ctx(**kw):
    base = dict(host="127.0.0.1", port=8090, model_path=GGUF.source, gpu_indices=(1,))
    base.update(kw)
    return LaunchContext(**base)


def test_single_gpu_argv_is_exact():
    spec = build_launch(GGUF, Profile("l", "llamacpp"), ctx())
    assert spec.argv == (
        "llama-server", "-m", "/models/phi-3-mini-q4.gguf",
        "--host", "127.0.0.1", "--port", "8090",
        "--alias", "phi3", "-ngl", "999", "--metrics",
    )
    assert spec.env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "1"}
    assert spec.serves_http and spec.port == 8090


def test_tensor_parallel_splits_layers_evenly_over_the_shards_gpus():
    model = Model("phi", "/models/phi.gguf", "phi", max_model_len=8192)
    profile = Profile("l", "llamacpp", tensor_parallel_size=3, extra_args=("-np", "4"))
    spec = build_launch(model, profile, ctx(model_path="/models/phi.gguf", gpu_indices=(0, 2, 5)))
    assert spec.argv == (
        "llama-server", "-m", "/models/phi.gguf", "--host", "127.0.0.1", "--port", "8090",
        "--alias", "phi", "-ngl", "999", "--metrics", "-c", "8192",
        "--split-mode", "layer", "--tensor-split", "1,1,1",
        "-np", "4",
    )
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "0,2,5"


def test_url_source_of_a_gguf_is_accepted_and_launched_from_the_fetched_file():
    model = Model("phi", "https://example.org/w/phi.Q4_K_M.gguf?download=1", "phi")
    spec = build_launch(model, Profile("l", "llamacpp"), ctx(model_path="/var/lib/llmgw/models/phi.gguf"))
    assert spec.argv[2] == "/var/lib/llmgw/models/phi.gguf"


def test_hub_id_source_is_refused_with_a_source_error():
    model = Model("phi", "microsoft/Phi-3-mini-4k-instruct-gguf", "phi")
    with pytest.raises(SourceError, match="hub id"):
        validate(model, Profile("l", "llamacpp"))


def test_non_gguf_source_is_refused():
    with pytest.raises(SourceError, match="not a .gguf file"):
        validate(Model("m", "/models/llama-safetensors", "m"), Profile("l", "llamacpp"))


def test_launch_with_a_model_path_that_is_not_a_file_path_is_a_context_error():
    with pytest.raises(LaunchContextError, match="local GGUF"):
        build_launch(GGUF, Profile("l", "llamacpp"), ctx(model_path="org/name"))


def test_multi_node_and_pipeline_parallel_are_refused_together():
    with pytest.raises(ProfileError) as e:
        validate_profile(Profile("l", "llamacpp", tensor_parallel_size=2,
                                 pipeline_parallel_size=2, nodes=2))
    text = "\n".join(e.value.problems)
    assert "nodes=2" in text and "one node" in text
    assert "pipeline_parallel_size=2" in text


OWNED = [
    ("-m", "x.gguf"), ("--model", "x.gguf"), ("-a", "x"), ("--alias", "x"),
    ("--host", "h"), ("--port", "1"), ("-ngl", "10"), ("--gpu-layers", "10"),
    ("--n-gpu-layers", "10"), ("-hf", "o/r"), ("-hfr", "o/r"), ("--hf-repo", "o/r"),
    ("-hff", "f"), ("--hf-file", "f"), ("-mu", "u"), ("--model-url", "u"),
    ("-dr", "d"), ("--docker-repo", "d"), ("-sm", "row"), ("--split-mode", "row"),
    ("-ts", "1,1"), ("--tensor-split", "1,1"), ("-dev", "CUDA0"), ("--device", "CUDA0"),
    ("--rpc", "h:1"), ("--api-prefix", "/x"), ("--models-dir", "/m"), ("--models-preset", "p.ini"),
]


@pytest.mark.parametrize("flag,value", OWNED)
@pytest.mark.parametrize("form", ["separate", "equals"])
def test_every_owned_flag_is_refused_in_both_forms(flag, value, form):
    args = (flag, value) if form == "separate" else (f"{flag}={value}",)
    with pytest.raises(ProfileError) as e:
        validate_profile(Profile("l", "llamacpp", extra_args=args))
    assert len(e.value.problems) == 1
    assert flag in e.value.problems[0]


def test_short_flags_are_matched_exactly_not_by_prefix():
    # -mg (main GPU) and -md (draft model) start like -m but are different flags.
    validate_profile(Profile("l", "llamacpp", extra_args=("-mg", "0", "-np", "8", "-fa", "on")))


def test_ctx_size_is_owned_when_the_model_declares_max_model_len():
    declared = Model("phi", "/m/phi.gguf", "phi", max_model_len=4096)
    with pytest.raises(ProfileError, match="max_model_len"):
        validate(declared, Profile("l", "llamacpp", extra_args=("-c", "2048")))
    validate(GGUF, Profile("l", "llamacpp", extra_args=("-c", "2048")))


@pytest.mark.parametrize("key", ["LLAMA_ARG_PORT", "LLAMA_ARG_MODEL", "LLAMA_ARG_N_GPU_LAYERS",
                                 "LLAMA_ARG_MODELS_DIR", "CUDA_VISIBLE_DEVICES"])
def test_env_spellings_of_owned_flags_are_refused(key):
    with pytest.raises(ProfileError, match=key):
        validate_profile(Profile("l", "llamacpp", env=((key, "1"),)))
