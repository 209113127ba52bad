"""Engines start on the GPUs topology-aware placement chose, through real processes.

One ``llmgw agent`` whose hardware file is the 8-GPU PCIe box of
tests/fixtures/hardware/pcie-8gpu-bridged-2socket.yaml (NVLink bridges pair
(0,1)(2,3)(4,5)(6,7); GPUs 0-3 on one socket, 4-7 on the other), with GPU 3
used by a process that is no engine (a ``sleep`` this test started), so the
agent withholds it.  The catalog asks for one TP=4 replica and one TP=1
replica.  Lowest free indices would give the TP=4 group GPUs 0,1,2,4 (three
islands, both sockets) and the TP=1 replica GPU 0 (splitting the intact pair
0,1); placement by score gives 4,5,6,7 (two whole pairs on one socket) and
GPU 2 (whose partner is the withheld GPU 3).  The engine simulator's
processes must carry exactly those ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from fleet import GIB, Fleet

pytestmark = pytest.mark.integration

BOX = Path(__file__).parents[1] / "fixtures" / "hardware" / "pcie-8gpu-bridged-2socket.yaml"


def engine_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_engines_get_the_gpus_placement_by_score_chose(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    foreign = subprocess.Popen(["sleep", "100000"], env=env, start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        with Fleet(tmp_path, nodes={"a": 8}) as f:
            f.config["profiles"].append({"name": "tp4", "engine": "vllm", "start_timeout": 60,
                                         "tensor_parallel_size": 4})
            f.config["deployments"] = [{"model": "tiny", "profile": "tp4", "replicas": 1},
                                       {"model": "tiny", "profile": "sim", "replicas": 1}]
            f.write_config()
            doc = yaml.safe_load(BOX.read_text())
            doc["node_id"] = f.node_ids["a"]
            doc["gpus"][3]["processes"] = [{"pid": foreign.pid, "used_memory_bytes": 8 * GIB}]
            (tmp_path / "a" / "hardware.yaml").write_text(yaml.safe_dump(doc))
            f.start()

            ready = f.wait_ready(2)
            gpus = {r["profile"]: r["shards"][0]["gpus"] for r in ready}
            assert gpus == {"tp4": [4, 5, 6, 7], "sim": [2]}, f.dump()

            # What the engines were really started with.
            seen = {}
            for pid in f.engine_pids():
                e = engine_env(pid)
                seen[e["LLMGW_SHARD_ID"]] = e.get("CUDA_VISIBLE_DEVICES")
            by_profile = {r["profile"]: seen[r["shards"][0]["shard_id"]] for r in ready}
            assert by_profile == {"tp4": "4,5,6,7", "sim": "2"}, seen

            # The node carried its matrix; the control plane logged the choice in the topology's words.
            node = f.try_node("a")
            assert node["hardware"]["topology"]["links"][0] == {"gpus": [0, 1], "tier": "NV", "nvlinks": 4}
            assert node["hardware"]["gpu_reason"].startswith(f"GPU 3 withheld: in use by pid {foreign.pid} (sleep)")
            log = f.server.output(10**7)
            assert "placed (topology): GPUs 4,5,6,7 on %s: 2 NVLink islands (4,5 | 6,7) joined by NODE" % (
                f.node_ids["a"]) in log, log[-3000:]
            assert "placed (best-fit): GPU 2 on %s: best fit: GPU 0 would split a free NVLink island" % (
                f.node_ids["a"]) in log, log[-3000:]
            assert foreign.poll() is None, "a process that is not ours is never signalled"
    finally:
        foreign.kill()
        foreign.wait()
