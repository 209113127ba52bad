"""The quickstart's real-engine node inventory (inventory/local/engine_node.py): its shape is
what group_vars/all/fleet.yml and group_vars/llmgw_agents/node.yml read, its catalog entries
pass the server schema, and vLLM's CPU settings are those the real-engine tests run with."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from llmgw.settings import load_server_settings

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "inventory" / "local" / "engine_node.py"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


engine_node = _load("engine_node", SCRIPT)


def _write(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_vllm_inventory_adds_the_cpu_node_and_one_replica(tmp_path):
    model = tmp_path / "tiny-llama-hf"
    model.mkdir()
    out = tmp_path / "inv" / "vllm.yml"
    run = _write("vllm", str(out), "--model", str(model),
                 "--", "/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server")
    assert run.returncode == 0, run.stderr
    doc = yaml.safe_load(out.read_text())
    spec = doc["all"]["vars"]["llmgw_local_engine"]
    assert spec["node"] == "local-cpu0" and spec["engine"] == "vllm"
    assert spec["command"] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert spec["model"] == {"name": "tiny-llama-hf", "source": str(model)}
    assert spec["profile"]["engine"] == "vllm" and spec["profile"]["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert ["--block-size", "32"] == spec["profile"]["extra_args"][2:4]
    hosts = doc["all"]["children"]["llmgw_agents"]["hosts"]
    assert hosts == {"local-cpu0": {"_local_inventory": str(ROOT / "inventory" / "local")}}
    # the node's hardware file is where node.yml looks for it
    assert (ROOT / "inventory/local/files/engine-node/local-cpu0.yaml").is_file()


def test_llamacpp_needs_the_digest_and_a_model_that_exists(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    out = tmp_path / "llamacpp.yml"
    no_sha = _write("llamacpp", str(out), "--model", str(gguf), "--", "/bin/llama-server")
    assert no_sha.returncode == 2 and "--sha256" in no_sha.stderr
    missing = _write("llamacpp", str(out), "--model", str(tmp_path / "nope"), "--sha256", "0" * 64,
                     "--", "/bin/llama-server")
    assert missing.returncode == 2 and "not an existing absolute path" in missing.stderr
    assert not out.exists()  # nothing written on a refusal
    ok = _write("llamacpp", str(out), "--model", str(gguf), "--sha256", "0" * 64, "--", "/bin/llama-server")
    assert ok.returncode == 0, ok.stderr
    spec = yaml.safe_load(out.read_text())["all"]["vars"]["llmgw_local_engine"]
    assert spec["engine"] == "llamacpp" and spec["command"] == ["/bin/llama-server"]
    assert spec["model"]["sha256"] == "0" * 64


@pytest.mark.parametrize("engine", ["llamacpp", "vllm"])
def test_catalog_entries_load_beside_the_quickstart_catalog(tmp_path, engine):
    """What fleet.yml appends to files/server.yaml is a valid server.yaml (schema and semantic checks)."""
    model = tmp_path / "model"
    model.mkdir()
    spec = engine_node.engine_spec(engine, ["/bin/engine"], str(model), "0" * 64)
    server = yaml.safe_load((ROOT / "inventory/local/files/server.yaml").read_text())
    server["models"].append(spec["model"])
    server["profiles"].append(spec["profile"])
    server["deployments"].append({"model": spec["model"]["name"], "profile": spec["profile"]["name"], "replicas": 1})
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump(server))
    settings = load_server_settings(path)  # raises ConfigInvalid, naming the key, on a bad entry
    assert settings.catalog.profiles[spec["profile"]["name"]].engine == engine


def test_vllm_settings_match_the_real_engine_tests():
    sys.path.insert(0, str(ROOT / "tests/engines"))  # vllmcpu imports its neighbour pinned
    vllmcpu = _load("vllmcpu", ROOT / "tests/engines/vllmcpu.py")
    assert engine_node.VLLM_CPU_ENV == vllmcpu.ENGINE_ENV
    args = engine_node.VLLM_CPU_ARGS
    for flag, value in zip(vllmcpu.ENGINE_ARGS[::2], vllmcpu.ENGINE_ARGS[1::2]):
        assert args[args.index(flag) + 1] == value, flag
