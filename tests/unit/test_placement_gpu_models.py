"""A tensor-parallel group is one GPU model: a box of 4 H100 (NVLinked) and 4 L40S (PCIe).

With GPU 0 busy, the three free H100s joined to one L40S scored better than
the four free L40S wherever the L40S pairs were no closer than H100-to-L40S
(one socket, every PCIe pair NODE) or unknown (no topology matrix): the
group then ran at the L40S's pace with the H100s' memory given away.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from llmgw.catalog import Model, Profile
from llmgw.hardware.simulated import inventory_from_document
from llmgw.placement import NodeCapacity, PlacementIndex, PlacementRequest, place

GIB = 1 << 30
H100, L40S = "NVIDIA H100 80GB HBM3", "NVIDIA L40S"


def mixed_box(matrix: bool) -> dict:
    gpus = []
    for i in range(8):
        h100 = i < 4
        gpus.append({"index": i, "uuid": f"GPU-mixed-{i}", "name": H100 if h100 else L40S,
                     "memory_bytes": (80 if h100 else 48) * GIB, "pci_bus_id": f"00000000:{0x18 + i:02X}:00.0",
                     "nvlink_peers": [j for j in range(4) if j != i] if h100 else []})
    doc = {"node_id": "mixed-01", "gpu_source": "simulated", "gpus": gpus, "nvlink_known": True}
    if matrix:  # one socket: every pair not on NVLink meets at NODE
        doc["topology"] = {"links": [{"gpus": [a, b], **({"tier": "NV", "nvlinks": 18} if b < 4 else {"tier": "NODE"})}
                                     for a in range(8) for b in range(a + 1, 8)]}
    return doc


def request(tp: int, size: int | None = 10 * GIB) -> PlacementRequest:
    return PlacementRequest(model=Model(name="m", source="org/m", served_name="m"),
                            profile=Profile(name=f"tp{tp}", engine="vllm", tensor_parallel_size=tp),
                            weights_bytes=size)


@pytest.mark.parametrize("matrix", [True, False], ids=["one-socket-matrix", "no-matrix"])
def test_tp4_with_an_h100_busy_takes_the_four_l40s_never_three_h100_and_one_l40s(matrix):
    inv = inventory_from_document(mixed_box(matrix))
    node = NodeCapacity(inv, frozenset(range(1, 8)))
    result = place(request(4), [node])
    assert result.placement is not None, result.reason
    assert result.placement.shards[0].gpu_indices == (4, 5, 6, 7)
    # The fleet index reaches the same GPUs.
    assert PlacementIndex([node]).place(request(4)).placement.shards[0].gpu_indices == (4, 5, 6, 7)
    # All free: the four H100s (NVLink) win.
    assert place(request(4), [NodeCapacity(inv, frozenset(range(8)))]).placement.shards[0].gpu_indices == (0, 1, 2, 3)


def test_no_group_of_one_model_is_a_refusal_that_says_so():
    inv = inventory_from_document(mixed_box(True))
    node = NodeCapacity(inv, frozenset({1, 2, 3, 4, 5, 6}))
    result = place(request(4), [node])
    assert result.placement is None
    (verdict,) = result.verdicts
    assert verdict.reason == (f"6 free GPUs, no 4 of one model (3 {H100}, 3 {L40S}): a tensor-parallel group "
                              "is one GPU model, needs 4")
    assert "1 too few GPUs of one model" in result.reason
    assert "1 too few GPUs of one model" in PlacementIndex([node]).place(request(4)).reason


def test_explain_over_the_mixed_box_file_never_mixes_models(tmp_path):
    """Through the command in its own process: GPU 0 in use, TP=4 goes to the L40S."""
    doc = mixed_box(False)
    doc["gpus"][0]["processes"] = [{"pid": 4242}]
    hw = tmp_path / "mixed.yaml"
    hw.write_text(yaml.safe_dump(doc))
    cfg = tmp_path / "server.yaml"
    cfg.write_text(
        "api: {listen: {port: 8443}}\ninsecure_no_tls: true\n"
        "models: [{name: m, source: org/m, size_bytes: 10000000000}]\n"
        "profiles: [{name: tp4, engine: vllm, tensor_parallel_size: 4}]\n"
        "deployments: [{model: m, profile: tp4, replicas: 1}]\n")
    res = subprocess.run([sys.executable, "-m", "llmgw", "ctl", "explain", "--config", str(cfg), "--hardware", str(hw),
                          "-o", "json"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, (res.stdout, res.stderr)
    (tp4,) = json.loads(res.stdout)
    assert tp4["placement"]["shards"][0]["gpus"] == [4, 5, 6, 7]


def fabric_node(node_id: str, name: str):
    from llmgw.hardware.types import FabricStatus, HardwareInventory

    doc = mixed_box(False)
    doc["node_id"] = node_id
    for g in doc["gpus"]:
        g["name"], g["nvlink_peers"] = name, [j for j in range(8) if j != g["index"]]
    inv = inventory_from_document(doc)
    fabric = FabricStatus("ib-a", ("mlx5_0",), ("mlx5_0",), 400.0, link_layer="InfiniBand")
    return NodeCapacity(HardwareInventory(**{**inv.__dict__, "fabrics": (fabric,)}), frozenset(range(8)))


def multi(tp: int, nodes: int) -> PlacementRequest:
    return PlacementRequest(model=Model(name="m", source="org/m", served_name="m"),
                            profile=Profile(name="multi", engine="vllm", tensor_parallel_size=tp, nodes=nodes),
                            weights_bytes=None)


def test_the_ranks_of_a_multi_node_replica_are_one_gpu_model():
    a, b, c = fabric_node("a", H100), fabric_node("b", "NVIDIA A100-SXM4-80GB"), fabric_node("c", H100)
    placed = place(multi(16, 2), [a, b, c]).placement
    assert placed is not None and placed.nodes == ("a", "c")
    refused = place(multi(16, 2), [a, b])
    assert refused.placement is None
    assert ("only 1 of the 2 nodes on fabric ib-a with 8 free GPUs have them of one GPU model, needs 2"
            in refused.verdicts[0].reason), refused.verdicts
