"""The agent rediscovers its hardware on every (re)connection and every discovery.interval, through real processes.

One ``llmgw agent`` process lives through the whole test with a simulated
hardware file and a copy of a sysfs fixture declaring fabric ``ib-a`` on
mlx5_0 and mlx5_1.  The hardware changes under it (a GPU fewer, an adapter's
port falling from ACTIVE to INIT, and back), and what the control plane's
API says about the node follows after each reconnection: once across a
control plane restart, once with the control plane kept running and the
stream forced down (the server frozen until the agent's keepalive gives up
on it).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from fleet import Fleet, hardware_file, until

pytestmark = pytest.mark.integration

SYSFS = Path(__file__).resolve().parents[1] / "fixtures" / "sysfs" / "healthy"


def port_state(sysfs: Path, hca: str) -> Path:
    return (sysfs / "class" / "infiniband" / hca).resolve() / "ports" / "1" / "state"


def write_hardware(path: Path, node_id: str, gpus: int) -> None:
    """A hardware file with ``gpus`` GPUs and no ``hcas``: adapters then come from sysfs."""
    hardware_file(path, node_id, gpus)
    doc = yaml.safe_load(path.read_text())
    for key in ("hcas", "fabrics", "undeclared_hcas"):
        doc.pop(key, None)
    path.write_text(yaml.safe_dump(doc))


def changeable_hardware(f: Fleet, tmp_path: Path, gpus: int, interval: float) -> tuple[Path, Path]:
    """No deployments; agent ``a`` reads a copy of the sysfs fixture (fabric ``ib-a`` on mlx5_0 and
    mlx5_1) and a hardware file of ``gpus`` GPUs, rediscovering every ``interval`` s: (sysfs, hardware file)."""
    f.config["deployments"] = []
    f.write_config()
    sysfs = tmp_path / "sysfs"
    shutil.copytree(SYSFS, sysfs, symlinks=True)
    agent_yaml = tmp_path / "a" / "agent.yaml"
    doc = yaml.safe_load(agent_yaml.read_text())
    doc["discovery"]["sysfs_root"] = str(sysfs / "class" / "infiniband")
    doc["discovery"]["interval"] = interval
    doc["fabrics"] = [{"name": "ib-a", "hcas": ["mlx5_0", "mlx5_1"]}]
    agent_yaml.write_text(yaml.safe_dump(doc))
    hw = Path(doc["discovery"]["hardware_file"])
    write_hardware(hw, f.node_ids["a"], gpus)
    return sysfs, hw


def hca_states(n: dict) -> dict[str, str]:
    return {h["name"]: h["ports"][0]["state"] for h in n["hardware"]["hcas"]}


def test_hardware_changed_between_connections_reaches_the_control_plane_on_reconnect(tmp_path):
    with Fleet(tmp_path, nodes={"a": 4}, replicas=0, agent_keepalive=1.0,
               lifecycle={"unreachable_after": 60, "lost_after": 120}) as f:
        sysfs, hw = changeable_hardware(f, tmp_path, gpus=4, interval=0)  # only connections rediscover
        f.start()
        agent = f.agents["a"]

        first = until(lambda: (n := f.try_node("a")) and n["connected"] and n, "the node registered", on_timeout=f.dump)
        assert first["gpus_total"] == 4
        assert hca_states(first) == {"mlx5_0": "ACTIVE", "mlx5_1": "ACTIVE"}
        (fabric,) = first["fabrics"]
        assert fabric["advertised_hcas"] == ["mlx5_0", "mlx5_1"] and fabric["problems"] == []

        # 1. The control plane goes away; while it is away a GPU disappears and mlx5_1 drops to INIT.
        f.server.kill()
        write_hardware(hw, f.node_ids["a"], 3)
        port_state(sysfs, "mlx5_1").write_text("2: INIT\n")
        f.server.start()
        f.wait_healthy()
        after = until(lambda: (n := f.try_node("a")) and n["connected"] and n, "the node registered with the restarted "
                      "control plane", on_timeout=f.dump)
        assert after["gpus_total"] == 3 and [g["index"] for g in after["gpus"]] == [0, 1, 2]
        assert hca_states(after) == {"mlx5_0": "ACTIVE", "mlx5_1": "INIT"}
        (fabric,) = after["fabrics"]
        assert fabric["advertised_hcas"] == ["mlx5_0"]
        assert any("mlx5_1" in p and "INIT" in p for p in fabric["problems"]), fabric
        assert agent.alive() and agent.lives == 1, "the same agent process, rediscovering"

        # 2. The control plane stays up: the hardware comes back, and only a reconnection tells it so.
        regs = after["registrations"]
        write_hardware(hw, f.node_ids["a"], 4)
        port_state(sysfs, "mlx5_1").write_text("4: ACTIVE\n")
        assert f.try_node("a")["gpus_total"] == 3, "nothing is re-read while the stream stays up"
        f.drop_stream(agent)
        back = until(lambda: (n := f.try_node("a")) and n["connected"] and n["registrations"] > regs and n,
                     "the agent to register again", on_timeout=f.dump)
        assert back["gpus_total"] == 4 and back["state"] == "ready"
        assert hca_states(back) == {"mlx5_0": "ACTIVE", "mlx5_1": "ACTIVE"}
        assert back["fabrics"][0]["advertised_hcas"] == ["mlx5_0", "mlx5_1"]
        assert agent.alive() and agent.lives == 1


def test_hardware_changed_while_connected_reaches_the_control_plane_without_a_reconnection(tmp_path):
    """discovery.interval: a GPU gone and an adapter port fallen to INIT stop being advertised while the
    stream stays up; both come back the same way."""
    with Fleet(tmp_path, nodes={"a": 2}, replicas=0) as f:
        sysfs, hw = changeable_hardware(f, tmp_path, gpus=2, interval=0.3)
        f.start()
        first = until(lambda: (n := f.try_node("a")) and n["connected"] and n, "the node registered", on_timeout=f.dump)
        regs = first["registrations"]
        assert first["gpus_total"] == 2 and first["fabrics"][0]["advertised_hcas"] == ["mlx5_0", "mlx5_1"]

        write_hardware(hw, f.node_ids["a"], 1)
        port_state(sysfs, "mlx5_1").write_text("2: INIT\n")
        changed = until(lambda: (n := f.try_node("a")) and n["gpus_total"] == 1
                        and n["fabrics"][0]["advertised_hcas"] == ["mlx5_0"] and n,
                        "the change to reach the control plane", on_timeout=f.dump)
        assert changed["registrations"] == regs and changed["connected"], "no reconnection was needed"
        assert any("mlx5_1" in p and "INIT" in p for p in changed["fabrics"][0]["problems"])
        assert "hardware changed while connected" in f.agents["a"].output()

        write_hardware(hw, f.node_ids["a"], 2)
        port_state(sysfs, "mlx5_1").write_text("4: ACTIVE\n")
        back = until(lambda: (n := f.try_node("a")) and n["gpus_total"] == 2
                     and n["fabrics"][0]["advertised_hcas"] == ["mlx5_0", "mlx5_1"] and n,
                     "the hardware to come back", on_timeout=f.dump)
        assert back["registrations"] == regs
