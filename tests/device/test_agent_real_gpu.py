"""The agent on a machine with an NVIDIA driver: what NVML finds registers, and an
engine starts on the GPU placement chose.

Everywhere else the agent's GPUs come from hardware files; this is the one test
that goes through a real driver end to end (control plane, agent, engine
simulator standing in for vLLM, over mutual TLS). It skips, saying why, where
NVML sees no GPU. With ``LLMGW_DEVICE_OUT`` set it also writes what it saw there
(the nodes and replicas as the API gave them, the engine's environment).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from fleet import Fleet
from llmgw.hardware.nvml import discover_gpus

pytestmark = pytest.mark.integration


def _engine_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    pairs = (item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)
    return {k: v for k, v in pairs if k.startswith(("CUDA_", "LLMGW_SHARD", "NCCL_"))}


def test_agent_registers_the_real_gpus_and_starts_an_engine_on_one(tmp_path):
    found = discover_gpus()
    if not found.gpus:
        pytest.skip(f"no GPU through NVML on this machine: {found.reason}")
    with Fleet(tmp_path, {"gpu": 1}, replicas=1) as fleet:
        agent_yaml = tmp_path / "gpu" / "agent.yaml"
        cfg = yaml.safe_load(agent_yaml.read_text())
        cfg["discovery"] = {"gpus": "nvml"}  # and the host's own /sys/class/infiniband
        agent_yaml.write_text(yaml.safe_dump(cfg))
        fleet.start()
        (replica,) = fleet.wait_ready(1)
        (node,) = fleet.get("/v1/nodes")["nodes"]
        (shard,) = replica["shards"]
        env = _engine_env(shard["pid"])
        if os.environ.get("LLMGW_DEVICE_OUT"):
            out = Path(os.environ["LLMGW_DEVICE_OUT"])
            out.mkdir(parents=True, exist_ok=True)
            (out / "agent-e2e.json").write_text(json.dumps(
                {"nodes": fleet.get("/v1/nodes"), "replicas": fleet.replicas(), "engine_env": env,
                 "ctl_nodes": fleet.ctl("nodes", check=False).stdout,
                 "ctl_replicas": fleet.ctl("replicas", check=False).stdout}, indent=1, sort_keys=True))

    # What the control plane shows is what NVML said, GPU for GPU.
    assert [(g["index"], g["uuid"], g["name"], g["memory_bytes"]) for g in node["gpus"]] == [
        (g.index, g.uuid, g.name, g.memory_bytes) for g in found.gpus]
    assert node["nvlink_known"] == found.nvlink_known
    # The engine sees exactly the GPU it was placed on, numbered as NVML numbers it.
    gpus = shard["gpus"]
    assert len(gpus) == 1 and gpus[0] in [g.index for g in found.gpus]
    assert env["CUDA_VISIBLE_DEVICES"] == str(gpus[0])
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
