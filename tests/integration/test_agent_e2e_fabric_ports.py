"""Fabric rules through real processes: sysfs trees in the kernel's format, two agents,
a two-node replica, and the NCCL environment its engines really get.

Node a reads ``tests/fixtures/sysfs/dualport`` (mlx5_0 has lost a rail: port 1 ACTIVE,
port 2 DOWN; mlx5_1 has both), node b ``mixed_link_layer`` (mlx5_0 InfiniBand, mlx5_1
RoCE).  Both declare fabric ib-a = mlx5_0, mlx5_1.  Node a must advertise exactly the
live ports (``mlx5_0:1`` and all of ``mlx5_1``); node b must leave the RoCE card out and
say why; and each rank's engine must be told exactly its node's ports in NCCL_IB_HCA.
An agent on ``vf_zero_guid`` (two virtual functions, zero GUIDs, names swapped at boot)
must use neither card and name where each recorded one went.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fleet import Fleet, edit_agent_config, until

pytestmark = pytest.mark.integration

SYSFS = Path(__file__).parents[1] / "fixtures" / "sysfs"


def on_sysfs(f: Fleet, name: str, tree: str) -> None:
    hw = f.agents[name].cwd / "hardware.yaml"
    doc = yaml.safe_load(hw.read_text())
    doc.pop("hcas", None)  # adapters come from sysfs, as on a real node
    hw.write_text(yaml.safe_dump(doc))

    def change(d):
        d["fabrics"] = [{"name": "ib-a", "hcas": ["mlx5_0", "mlx5_1"]}]
        d["discovery"]["sysfs_root"] = str(SYSFS / tree / "class" / "infiniband")

    edit_agent_config(f.agents[name], change)


def engine_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_engines_are_told_exactly_the_usable_ports_of_their_node(tmp_path):
    with Fleet(tmp_path, nodes={"a": 1, "b": 1}, replicas=1, profile={"nodes": 2, "tensor_parallel_size": 2},
               restart={"backoff_initial": 300, "backoff_max": 300}) as f:
        on_sysfs(f, "a", "dualport")
        on_sysfs(f, "b", "mixed_link_layer")
        f.start()
        nodes = until(lambda: len(n := f.nodes()) == 2 and n, "both nodes registered", on_timeout=f.dump)
        fab = {name: nodes[f.node_ids[name]]["fabrics"][0] for name in ("a", "b")}
        assert fab["a"]["advertised_hcas"] == ["mlx5_0:1", "mlx5_1"]
        assert fab["b"]["advertised_hcas"] == ["mlx5_0"] and fab["b"]["link_layer"] == "InfiniBand"
        assert fab["b"]["problems"] == [
            "mlx5_1: port 1 is Ethernet (RoCE), fabric ib-a is InfiniBand (taken from mlx5_0 port 1): "
            "InfiniBand and RoCE ports cannot talk to each other; not advertised"]

        (r,) = f.wait_ready(1)
        want = {f.node_ids["a"]: "=mlx5_0:1,mlx5_1", f.node_ids["b"]: "=mlx5_0"}
        for s in r["shards"]:
            assert engine_env(s["pid"])["NCCL_IB_HCA"] == want[s["node_id"]], s


def test_virtual_functions_with_zero_guids_that_swapped_names_are_not_advertised(tmp_path):
    """Two SR-IOV virtual functions with all-zero node GUIDs swapped names at boot: the agent
    compares the PCI addresses recorded at rollout and uses neither, saying where each went."""
    with Fleet(tmp_path, nodes={"a": 1}, replicas=0) as f:
        on_sysfs(f, "a", "vf_zero_guid")
        zero = "0000:0000:0000:0000"
        edit_agent_config(f.agents["a"], lambda d: d["fabrics"][0].update(identities={
            "mlx5_0": {"node_guid": zero, "pci_bus_id": "0000:19:00.0"},
            "mlx5_1": {"node_guid": zero, "pci_bus_id": "0000:1a:00.0"}}))
        f.start()
        node = until(lambda: (n := f.nodes().get(f.node_ids["a"])) and n, "the node registered", on_timeout=f.dump)
        (fabric,) = node["fabrics"]
        assert fabric["advertised_hcas"] == []
        assert fabric["problems"] == [
            f"mlx5_0: not the card recorded at rollout (now node GUID {zero}, PCI 0000:1a:00.0, recorded node GUID "
            f"{zero}, PCI 0000:19:00.0); the recorded card is now mlx5_1: renamed at boot? update the declaration",
            f"mlx5_1: not the card recorded at rollout (now node GUID {zero}, PCI 0000:19:00.0, recorded node GUID "
            f"{zero}, PCI 0000:1a:00.0); the recorded card is now mlx5_0: renamed at boot? update the declaration"]
