"""A GPU another process uses is withheld by the node, through real server and agent processes.

One ``llmgw agent`` with two simulated GPUs whose hardware file says what
NVML would: GPU 0 is used by a process that is no engine (a ``sleep`` this
test started, standing for another user's job).  The control plane's
``/v1/nodes`` shows the node offering GPU 1 only, with the reason naming
GPU 0, the pid and its command name, and the replica is placed on GPU 1.
The foreign process then exits and NVML's answer changes (GPU 0 lists
nothing; GPU 1 lists the replica's own engine, which must not withhold it);
after the stream is forced down and the same agent registers again, GPU 0
is advertised again and the replica keeps serving, untouched.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from fleet import GIB, Fleet, until

pytestmark = pytest.mark.integration


def set_processes(path: Path, processes: dict[int, list[int]]) -> None:
    """Rewrite the hardware file's per-GPU process lists (GPU index -> pids), as NVML's answer."""
    doc = yaml.safe_load(path.read_text())
    for g in doc["gpus"]:
        g["processes"] = [{"pid": p, "used_memory_bytes": 8 * GIB} for p in processes.get(g["index"], [])]
    path.write_text(yaml.safe_dump(doc))


def test_a_gpu_used_by_a_foreign_process_is_withheld_until_it_is_gone(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    foreign = subprocess.Popen(["sleep", "100000"], env=env, start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        with Fleet(tmp_path, nodes={"a": 2}, replicas=1, agent_keepalive=1.0,
                   lifecycle={"unreachable_after": 60, "lost_after": 120}) as f:
            hw = tmp_path / "a" / "hardware.yaml"
            set_processes(hw, {0: [foreign.pid]})
            f.start()
            agent = f.agents["a"]

            (replica,) = f.wait_ready(1)
            (shard,) = replica["shards"]
            assert shard["gpus"] == [1], "placed on the GPU nobody else uses"
            first = f.try_node("a")
            assert first["gpus_total"] == 1 and [g["index"] for g in first["gpus"]] == [1]
            assert first["hardware"]["gpu_reason"] == (
                f"GPU 0 withheld: in use by pid {foreign.pid} (sleep), not an llmgw engine")
            assert first["gpus"][0]["nvlink_peers"] == [], "no peer points at the withheld GPU"
            assert foreign.poll() is None, "a process that is not ours is never signalled"
            assert f"GPU 0 withheld: in use by pid {foreign.pid} (sleep)" in agent.life_output()

            # The foreign job ends; NVML now lists only our own engine, on GPU 1.
            foreign.kill()
            foreign.wait()
            engine_pid = shard["process"]["pid"]
            set_processes(hw, {1: [engine_pid]})
            regs = first["registrations"]
            assert f.try_node("a")["gpus_total"] == 1, "nothing is re-read while the stream stays up"

            f.drop_stream(agent)
            back = until(lambda: (n := f.try_node("a")) and n["connected"] and n["registrations"] > regs and n,
                         "the agent to register again", on_timeout=f.dump)
            assert back["gpus_total"] == 2 and "gpu_reason" not in back["hardware"], back["hardware"]
            assert {g["index"]: g["shard"] for g in back["gpus"]} == {0: None, 1: shard["shard_id"]}
            assert [p["pid"] for p in back["hardware"]["gpus"][1]["processes"]] == [engine_pid]
            assert f"GPU 0: pid {foreign.pid} no longer uses it; advertised again" in agent.life_output()

            (still,) = f.wait_ready(1)
            assert still["replica_id"] == replica["replica_id"]
            assert still["shards"][0]["process"] == shard["process"], "our own engine was left alone"
            assert agent.alive() and agent.lives == 1, "the same agent process, rediscovering"
    finally:
        if foreign.poll() is None:
            foreign.kill()
        foreign.wait()
