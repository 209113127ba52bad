"""The engine's own memory cap counts in the fit (vLLM --gpu-memory-utilization, SGLang --mem-fraction-static).

40 GiB of weights on an 80 GB card with ``--gpu-memory-utilization 0.5``:
vLLM gets 39.8 GiB and cannot load them, after minutes of trying.  Placement
must refuse it up front, naming the flag, and place it where the share fits.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw.catalog import Model, Profile
from llmgw.config import ConfigInvalid
from llmgw.placement import PlacementRequest
from llmgw.placement.memory import memory_need
from llmgw.settings import load_server_settings

ROOT = Path(__file__).resolve().parents[2]
H100_BOX = ROOT / "tests" / "fixtures" / "hardware" / "hgx-h100-8gpu.yaml"  # 8 x 79.6 GiB
GIB = 1 << 30


def need(engine: str, *args: str, tp: int = 1):
    return memory_need(PlacementRequest(
        model=Model(name="m", source="org/m", served_name="m"),
        profile=Profile(name="p", engine=engine, tensor_parallel_size=tp, extra_args=args),
        weights_bytes=40 * GIB, memory_headroom=0.2))


@pytest.mark.parametrize("engine,args", [
    ("vllm", ("--gpu-memory-utilization", "0.5")),
    ("vllm", ("--gpu_memory_utilization=0.5",)),
    ("vllm", ("--gpu-memory-util", "0.5")),  # argparse abbreviation
    ("vllm", ("--gpu-memory-utilization", "0.9", "--gpu-memory-utilization", "0.5")),  # the last one counts
    ("sglang", ("--mem-fraction-static", "0.5")),
])
def test_every_spelling_of_the_engine_cap_is_read(engine, args):
    n = need(engine, *args)
    assert n.fraction == 0.5
    assert n.per_gpu_bytes == 2 * n.share_bytes


def test_no_cap_and_llamacpp_leave_the_fit_as_it_was():
    assert need("vllm").fraction is None and need("vllm").per_gpu_bytes == need("vllm").share_bytes
    assert need("llamacpp", "--gpu-memory-utilization", "0.5").fraction is None


def _config(tmp_path, profiles: str) -> Path:
    cfg = tmp_path / "server.yaml"
    cfg.write_text(
        "api: {listen: {port: 8443}}\ninsecure_no_tls: true\n"
        f"models: [{{name: m, source: org/m, size_bytes: {40 * GIB}}}]\n"
        f"profiles: [{profiles}]\n"
        "deployments: [{model: m, profile: p, replicas: 1}]\n")
    return cfg


def test_an_out_of_range_cap_is_a_config_error_with_its_pointer(tmp_path):
    cfg = _config(tmp_path, "{name: p, engine: vllm, extra_args: [--gpu-memory-utilization, '1.5']}")
    with pytest.raises(ConfigInvalid) as e:
        load_server_settings(cfg)
    assert "/profiles/0/extra_args/0" in str(e.value) and "outside (0, 1]" in str(e.value)


@pytest.mark.parametrize("profile,placed", [
    ("{name: p, engine: vllm, extra_args: [--gpu-memory-utilization, '0.5']}", False),
    ("{name: p, engine: sglang, extra_args: [--mem-fraction-static, '0.5']}", False),
    ("{name: p, engine: vllm}", True),
    ("{name: p, engine: vllm, tensor_parallel_size: 2, extra_args: [--gpu-memory-utilization, '0.5']}", True),
])
def test_explain_refuses_weights_that_do_not_fit_the_engines_share_of_the_card(tmp_path, profile, placed):
    res = subprocess.run([sys.executable, "-m", "llmgw", "ctl", "explain", "--config", str(_config(tmp_path, profile)),
                          "--hardware", str(H100_BOX), "-o", "json"], capture_output=True, text=True, timeout=60)
    assert res.returncode == (0 if placed else 3), res.stderr
    (item,) = json.loads(res.stdout)
    assert item["placed"] is placed
    if not placed:
        reason = item["nodes"][0]["reason"]
        flag = "--mem-fraction-static" if "sglang" in profile else "--gpu-memory-utilization"
        assert reason.startswith(f"GPU memory too small: needs 48.0 GiB (weights 40.0 GiB + 20% headroom) within "
                                 f"{flag} 0.5: a GPU of 96.0 GiB, 0 of 8 free GPUs hold it"), reason
