"""Engine keys: each adapter hands the replica's key over the engine's own way, never in argv.

The simulator parses what the adapters build exactly as the engines would
(vLLM's VLLM_API_KEY, SGLang's --config file, llama.cpp's LLAMA_ARG_API_KEY),
so each test also checks that the engine ends up with exactly that key.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.catalog import Model, Profile
from llmgw.engines import LaunchContext, LaunchContextError, ProfileError, build_launch, validate_profile
from llmgw.sim.sim_args import parse_argv

KEY = "k" * 20 + "Ab3_-" + "z" * 20
HUB = Model(name="tiny", source="org/tiny", served_name="tiny")
GGUF = Model(name="g", source="/models/g.gguf", served_name="g")


def launch(engine: str, model: Model, tmp_path: Path, **kw):
    base = dict(host="10.0.0.5", port=8001, model_path=model.source, gpu_indices=(0,), api_key=KEY,
                secret_dir=str(tmp_path))
    base.update(kw)
    return build_launch(model, Profile("p", engine), LaunchContext(**base))


def simulated(spec, dialect: str, monkeypatch) -> tuple[str, ...]:
    """The keys the engine simulator reads from this launch (its argv after the binary, and its env)."""
    for name in ("VLLM_API_KEY", "LLAMA_ARG_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in spec.env.items():
        monkeypatch.setenv(name, value)
    # the engine's own command ("vllm serve", "llama-server", "python -m sglang.launch_server")
    # is replaced by the simulator's dialect word
    skip = {"vllm": 2, "llama-server": 1, "python": 3}[spec.argv[0]]
    return parse_argv([dialect, *spec.argv[skip:]]).api_keys


def test_vllm_reads_its_key_from_the_environment_not_argv(tmp_path, monkeypatch):
    spec = launch("vllm", HUB, tmp_path)
    assert KEY not in " ".join(spec.argv)
    assert spec.env["VLLM_API_KEY"] == KEY
    assert spec.files == ()
    assert simulated(spec, "serve", monkeypatch) == (KEY,)


def test_llamacpp_reads_its_key_from_the_environment_not_argv(tmp_path, monkeypatch):
    spec = launch("llamacpp", GGUF, tmp_path)
    assert KEY not in " ".join(spec.argv)
    assert spec.env["LLAMA_ARG_API_KEY"] == KEY
    assert simulated(spec, "llama-server", monkeypatch) == (KEY,)


def test_sglang_reads_its_key_from_a_private_config_file(tmp_path, monkeypatch):
    spec = launch("sglang", HUB, tmp_path)
    assert KEY not in " ".join(spec.argv)
    path = str(tmp_path / "sglang-config.yaml")
    assert spec.argv[-2:] == ("--config", path)
    (f,) = spec.files
    assert f.path == path and KEY in f.data
    assert KEY not in repr(spec), "the key is kept out of reprs (logs, tracebacks)"
    Path(f.path).write_text(f.data)
    assert simulated(spec, "sglang", monkeypatch) == (KEY,)


def test_sglang_without_a_secret_dir_is_a_context_error(tmp_path):
    with pytest.raises(LaunchContextError, match="--config file"):
        launch("sglang", HUB, tmp_path, secret_dir=None)


@pytest.mark.parametrize("engine,model", [("vllm", HUB), ("sglang", HUB), ("llamacpp", GGUF)])
def test_no_key_issued_adds_nothing(engine, model, tmp_path):
    with_key = launch(engine, model, tmp_path)
    without = launch(engine, model, tmp_path, api_key=None)
    assert without.files == () and not any("API_KEY" in k for k in without.env)
    assert len(without.argv) <= len(with_key.argv)


def test_worker_ranks_serve_no_http_and_get_no_key(tmp_path):
    profile = Profile("mn", "vllm", tensor_parallel_size=2, nodes=2)
    spec = build_launch(HUB, profile, LaunchContext(host="10.0.0.6", port=0, model_path=HUB.source, rank=1,
                                                    nnodes=2, master_addr="10.0.0.5", master_port=29500,
                                                    gpu_indices=(0,), api_key=KEY, secret_dir=str(tmp_path)))
    assert "VLLM_API_KEY" not in spec.env and not spec.serves_http


@pytest.mark.parametrize("engine,args", [
    ("vllm", ["--api-key", "mine"]),
    ("vllm", ["--api_key=mine"]),
    ("vllm", ["--api-k", "mine"]),
    ("sglang", ["--api-key", "mine"]),
    ("llamacpp", ["--api-key", "mine"]),
    ("llamacpp", ["--api-key-file", "/etc/keys"]),
])
def test_a_profile_cannot_set_the_engine_key(engine, args):
    with pytest.raises(ProfileError) as e:
        validate_profile(Profile("p", engine, extra_args=tuple(args)))
    assert "engine key" in str(e.value)
    assert e.value.paths == ("extra_args/0",)


@pytest.mark.parametrize("engine,var", [("vllm", "VLLM_API_KEY"), ("llamacpp", "LLAMA_ARG_API_KEY")])
def test_a_profile_cannot_set_the_key_variable(engine, var):
    with pytest.raises(ProfileError) as e:
        validate_profile(Profile("p", engine, env=((var, "mine"),)))
    assert e.value.paths == (f"env/{var}",)


@pytest.mark.parametrize("engine,model,owned", [
    ("vllm", HUB, {"VLLM_API_KEY", "VLLM_SERVER_DEV_MODE", "VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT"}),
    ("llamacpp", GGUF, {"LLAMA_ARG_API_KEY", "LLAMA_ARG_SSL_KEY_FILE"}),
])
def test_the_launch_names_every_variable_the_adapter_owns_for_the_launcher_to_drop(engine, model, owned, tmp_path):
    """What a profile may not set, the agent's own environment may not hand down either
    (popendriver leaves ``owned_env`` out of what the engine inherits)."""
    spec = launch(engine, model, tmp_path, api_key=None)
    assert owned <= spec.owned_env, spec.owned_env
    for var in spec.owned_env:
        with pytest.raises(ProfileError):
            validate_profile(Profile("p", engine, env=((var, "1"),)))
