"""A serving replica's GPU turns sick and the replica moves, through real processes.

Control plane and two agents (one simulated GPU each, rediscovering every
0.3 s), engines from the simulator through the vLLM adapter.  The hardware
file of the node serving the replica is rewritten with an Xid 79 on its GPU
(what the NVML event set reports for a GPU fallen off the bus): the agent
withholds the GPU and says why, the control plane stops the replica there
and starts one on the other node, and ``llmgw ctl nodes`` / ``ctl explain``
show the reason.  Removing the Xid from the file does not bring the GPU
back: an Xid is held until the agent restarts.

And the rule is one: with a node's GPUs sick from its first discovery, the
live placement and offline ``ctl explain`` over the same hardware file
choose the same GPU.
"""

from __future__ import annotations

import os

import pytest
import yaml

from fleet import Fleet, edit_agent_config, until

pytestmark = pytest.mark.integration


def set_health(f: Fleet, name: str, health: dict) -> None:
    path = f.agents[name].cwd / "hardware.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["gpus"][0]["health"] = health
    path.write_text(yaml.safe_dump(doc))


def test_replica_on_a_gpu_with_xid_79_is_moved_and_the_reason_shown(tmp_path):
    with Fleet(tmp_path, nodes={"a": 1, "b": 1}, replicas=1) as f:
        for agent in f.agents.values():
            edit_agent_config(agent, lambda doc: doc["discovery"].update(interval=0.3))
        f.start()
        (first,) = f.wait_ready(1)
        node_id = first["shards"][0]["node_id"]
        sick_name = next(n for n, i in f.node_ids.items() if i == node_id)
        other = next(i for i in f.node_ids.values() if i != node_id)
        pid = first["shards"][0]["pid"]

        set_health(f, sick_name, {"xid": [79]})
        node = until(lambda: (n := f.try_node(sick_name)) and n["hardware"].get("sick_gpus") and n,
                     "the agent to withhold its GPU", on_timeout=f.dump)
        assert node["gpus_total"] == 0 and node["connected"]
        (sick,) = node["hardware"]["sick_gpus"]
        assert sick["index"] == 0 and sick["reason"] == "Xid 79 (GPU has fallen off the bus)"
        assert node["hardware"]["gpu_reason"].startswith("GPU 0 withheld: Xid 79 (GPU has fallen off the bus) at 20")

        def moved() -> dict | None:
            rs = f.ready_replicas()
            return rs[0] if len(rs) == 1 and rs[0]["shards"][0]["node_id"] == other else None
        new = until(moved, "the replica to be Ready on the other node", on_timeout=f.dump)
        assert new["replica_id"] != first["replica_id"]
        until(lambda: not _alive(pid), "the engine on the sick GPU to be stopped", on_timeout=f.dump)

        nodes_out = f.ctl("nodes").stdout
        assert f"{node_id}: GPU 0 withheld: Xid 79 (GPU has fallen off the bus) at" in nodes_out, nodes_out
        explain = f.ctl("explain", "tiny").stdout
        assert (f"last failure ({first['replica_id']}): GPU 0 on {node_id} withheld as sick: "
                "Xid 79 (GPU has fallen off the bus)") in explain, explain
        assert "GPU 0 withheld" in f.agents[sick_name].output()

        # The file no longer lists the Xid (and gains a healthy GPU 1, so its re-reading shows):
        # GPU 0 stays withheld, since unchanged, until the agent restarts.
        path = f.agents[sick_name].cwd / "hardware.yaml"
        doc = yaml.safe_load(path.read_text())
        doc["gpus"][0].pop("health")
        doc["gpus"].append({**doc["gpus"][0], "index": 1, "uuid": "GPU-extra", "pci_bus_id": "00000000:20:00.0",
                            "nvlink_peers": []})
        path.write_text(yaml.safe_dump(doc))
        later = until(lambda: (n := f.try_node(sick_name)) and n["gpus_total"] == 1 and n,
                      "the file to be re-read", on_timeout=f.dump)
        assert [g["index"] for g in later["gpus"]] == [1]
        assert later["hardware"]["sick_gpus"] == node["hardware"]["sick_gpus"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_live_and_offline_placement_withhold_the_same_unfit_gpus(tmp_path):
    """The one rule, three callers: the agent advertises, the control plane places, and offline
    ``ctl explain`` over the same hardware file reaches the same GPU, each leaving out GPUs whose
    health says Xid 79, uncorrected ECC errors or a pending row remap."""
    import json
    import subprocess
    import sys

    with Fleet(tmp_path, nodes={"a": 4}, replicas=1) as f:
        path = f.agents["a"].cwd / "hardware.yaml"
        doc = yaml.safe_load(path.read_text())
        doc["gpus"][0]["health"] = {"xid": [79]}
        doc["gpus"][1]["health"] = {"ecc_uncorrected_volatile": 1}
        doc["gpus"][2]["health"] = {"remapped_rows_pending": True}
        path.write_text(yaml.safe_dump(doc))
        f.start()
        (live,) = f.wait_ready(1)
        node = f.try_node("a")
        assert [s["index"] for s in node["hardware"]["sick_gpus"]] == [0, 1, 2]
        assert [g["index"] for g in node["gpus"]] == [3]

        res = subprocess.run([sys.executable, "-m", "llmgw", "ctl", "explain", "--config", str(f.config_path),
                              "--hardware", str(path), "-o", "json"], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, (res.stdout, res.stderr)
        (offline,) = json.loads(res.stdout)
        assert [s["gpus"] for s in offline["placement"]["shards"]] == [s["gpus"] for s in live["shards"]] == [[3]]
