"""Simulated hardware files: the fixtures load, bad files name where, and the
schema accepts exactly what discovery produces."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from llmgw.config import ConfigInvalid, schema_errors
from llmgw.hardware.gpu_health import GPUHealth
from llmgw.hardware.infiniband import read_hcas, validate_fabrics
from llmgw.hardware.simulated import load_hardware_file
from llmgw.hardware.types import GPU, FabricDeclaration, HardwareInventory

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
HARDWARE = FIXTURES / "hardware"
IB_A = FabricDeclaration("ib-a", ("mlx5_0", "mlx5_1"))


def write(tmp_path: Path, doc, name: str = "hw.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def base_doc() -> dict:
    return yaml.safe_load((HARDWARE / "ib-a-node1.yaml").read_text())


def pointers(excinfo) -> dict[str, str]:
    return {e.pointer: e.message for e in excinfo.value.errors}


@pytest.mark.parametrize("path", sorted(HARDWARE.glob("*.yaml")), ids=lambda p: p.name)
def test_every_fixture_loads_and_round_trips(path):
    inv = load_hardware_file(path)
    assert inv.gpu_source == "simulated"
    assert HardwareInventory.from_dict(inv.to_dict()) == inv
    assert schema_errors(inv.to_dict(), "hardware") == []


def test_hgx_h100_every_gpu_peers_every_other():
    inv = load_hardware_file(HARDWARE / "hgx-h100-8gpu.yaml", node_id="n1")
    assert inv.node_id == "n1" and len(inv.gpus) == 8 and inv.nvlink_known
    assert all(g.name == "NVIDIA H100 80GB HBM3" and g.memory_bytes == 81559 * 2**20 for g in inv.gpus)
    for g in inv.gpus:
        assert set(g.nvlink_peers) == set(range(8)) - {g.index}


def test_pcie_pairs_and_no_gpu_node():
    pairs = load_hardware_file(HARDWARE / "pcie-4gpu-nvlink-pairs.yaml")
    assert [g.nvlink_peers for g in pairs.gpus] == [(1,), (0,), (3,), (2,)]
    none = load_hardware_file(HARDWARE / "no-gpu.yaml")
    assert none.gpus == () and "not found" in none.gpu_reason and not none.nvlink_known


def test_two_nodes_on_ib_a_recomputed_from_their_adapters():
    for n in (1, 2):
        inv = load_hardware_file(HARDWARE / f"ib-a-node{n}.yaml", fabrics=[IB_A])
        (fabric,) = inv.fabrics
        assert fabric.advertised_hcas == ("mlx5_0", "mlx5_1") and fabric.rate_gbps == 200.0
        assert fabric.problems == ()


def test_declared_fabrics_are_recomputed_not_taken_from_the_file(tmp_path):
    doc = base_doc()
    doc["hcas"][1]["ports"][0]["state"] = "INIT"  # the file's fabrics still claim mlx5_1
    path = write(tmp_path, doc)
    as_written = load_hardware_file(path)
    assert as_written.fabrics[0].advertised_hcas == ("mlx5_0", "mlx5_1")  # no declaration: kept
    inv = load_hardware_file(path, fabrics=[IB_A, FabricDeclaration("ib-b", ("mlx5_7",))])
    assert [f.advertised_hcas for f in inv.fabrics] == [("mlx5_0",), ()]
    assert inv.fabrics[0].problems == ("mlx5_1: no ACTIVE port (port 1: INIT, phys LinkUp); "
                                       "INIT with LinkUp: the cable is up but no subnet manager has activated the port",)
    assert inv.undeclared_hcas == ()


def test_json_file_and_one_sided_peers_made_symmetric(tmp_path):
    doc = {
        "node_id": "x", "gpu_source": "nvml",
        "gpus": [
            {"index": 0, "uuid": "GPU-a", "name": "NVIDIA L40S", "memory_bytes": 48 * 2**30,
             "pci_bus_id": "0000:01:00.0", "nvlink_peers": [1]},
            {"index": 1, "uuid": "GPU-b", "name": "NVIDIA L40S", "memory_bytes": 48 * 2**30,
             "pci_bus_id": "0000:02:00.0"},
        ],
    }
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(doc))
    inv = load_hardware_file(path)
    assert inv.gpu_source == "simulated"  # the GPUs did not come from NVML, whatever the file says
    assert [g.nvlink_peers for g in inv.gpus] == [(1,), (0,)]


@pytest.mark.parametrize(
    ("mutate", "pointer", "fragment"),
    [
        (lambda d: d["gpus"][1].pop("uuid"), "/gpus/1", "'uuid' is a required property"),
        (lambda d: d["gpus"][2].update(memory_bytes="80GB"), "/gpus/2/memory_bytes", "expected integer"),
        (lambda d: d["gpus"][0].update(pci_bus_id="07:00"), "/gpus/0/pci_bus_id", "does not match"),
        (lambda d: d.update(gpu_source="cuda"), "/gpu_source", "'cuda' is not one of 'nvml', 'simulated'"),
        (lambda d: d["hcas"][0]["ports"][0].update(state="ACTVE"), "/hcas/0/ports/0/state", "not one of"),
        (lambda d: d["hcas"][1]["ports"][0].update(link_layer="IB"), "/hcas/1/ports/0/link_layer", "not one of"),
        (lambda d: d["gpus"][0].update(nvlink=[1]), "/gpus/0/nvlink", "unknown key"),
        (lambda d: d.update(gpu_count=4), "/gpu_count", "unknown key"),
        (lambda d: d["fabrics"][0].update(rate_gbps=-1), "/fabrics/0/rate_gbps", "minimum"),
        (lambda d: d["gpus"][1].update(health={"xid": ["79"]}), "/gpus/1/health/xid/0", "expected integer"),
        (lambda d: d["gpus"][1].update(health={"ecc": 1}), "/gpus/1/health/ecc", "unknown key"),
    ],
)
def test_schema_errors_name_the_pointer(tmp_path, mutate, pointer, fragment):
    doc = base_doc()
    mutate(doc)
    with pytest.raises(ConfigInvalid) as excinfo:
        load_hardware_file(write(tmp_path, doc))
    found = pointers(excinfo)
    assert pointer in found, found
    assert fragment in found[pointer]
    assert str(tmp_path / "hw.yaml") in str(excinfo.value)


def test_a_gpus_health_block_is_read_as_its_health(tmp_path):
    doc = base_doc()
    doc["gpus"][1]["health"] = {"xid": [79], "ecc_uncorrected_volatile": 2, "not_checked": ["row remapping: x"]}
    inv = load_hardware_file(write(tmp_path, doc))
    assert inv.gpus[1].health == GPUHealth(xids=(79,), ecc_uncorrected_volatile=2, not_checked=("row remapping: x",))
    assert inv.gpus[0].health is None, "no block: health not read"
    assert HardwareInventory.from_dict(inv.to_dict()) == inv


def test_semantic_errors_name_the_pointer(tmp_path):
    doc = base_doc()
    doc["gpus"][3]["index"] = 1
    doc["gpus"][0]["nvlink_peers"] = [0, 1, 9]
    doc["hcas"][1]["name"] = "mlx5_0"
    doc["hcas"][0]["ports"].append(copy.deepcopy(doc["hcas"][0]["ports"][0]))
    with pytest.raises(ConfigInvalid) as excinfo:
        load_hardware_file(write(tmp_path, doc))
    found = pointers(excinfo)
    assert found["/gpus/3/index"] == "duplicate GPU index 1 (also /gpus/1)"
    assert found["/gpus/0/nvlink_peers/0"] == "GPU 0 cannot be its own NVLink peer"
    assert found["/gpus/0/nvlink_peers/2"] == "no GPU with index 9 in this file"
    assert found["/hcas/1/name"] == "duplicate adapter 'mlx5_0' (also /hcas/0)"
    assert found["/hcas/0/ports/1/port"] == "duplicate port 1 (also /hcas/0/ports/0)"


def test_not_yaml_and_not_an_object(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpus: [\n")
    with pytest.raises(ConfigInvalid, match="not valid YAML"):
        load_hardware_file(bad)
    with pytest.raises(ConfigInvalid, match="expected object"):
        load_hardware_file(write(tmp_path, ["a"], "list.yaml"))
    with pytest.raises(ConfigInvalid, match="cannot read"):
        load_hardware_file(tmp_path / "absent.yaml")


def test_schema_accepts_what_discovery_of_every_sysfs_tree_produces():
    for tree in sorted((FIXTURES / "sysfs").iterdir()):
        if not tree.is_dir():
            continue
        hcas = read_hcas(tree / "class" / "infiniband")
        statuses, undeclared = validate_fabrics([IB_A], hcas)
        inv = HardwareInventory(
            node_id="n", gpus=(GPU(0, "GPU-x", "NVIDIA H200", 150754820096, "00000000:18:00.0"),),
            hcas=hcas, fabrics=statuses, undeclared_hcas=undeclared,
            gpu_source="nvml", gpu_reason=None, nvlink_known=False,
        )
        assert schema_errors(inv.to_dict(), "hardware") == [], tree.name
        assert HardwareInventory.from_dict(inv.to_dict()) == inv


def test_topology_errors_name_the_pointer(tmp_path):
    doc = yaml.safe_load((HARDWARE / "pcie-4gpu-2switch.yaml").read_text())
    doc["topology"]["links"][0]["tier"] = "NV"  # 0-1, but nvlink_peers do not join them
    doc["topology"]["links"][1]["gpus"] = [0, 9]
    doc["topology"]["links"].append({"gpus": [1, 0], "tier": "PIX"})
    with pytest.raises(ConfigInvalid) as excinfo:
        load_hardware_file(write(tmp_path, doc))
    got = pointers(excinfo)
    assert got["/topology/links/0/tier"] == "NV but neither GPU lists the other in nvlink_peers"
    assert got["/topology/links/1/gpus"] == "no GPU with index 9 in this file"
    assert got["/topology/links/6/gpus"] == "duplicate pair [0, 1] (also /topology/links/0)"


def test_files_without_topology_stay_valid_and_unknown():
    inv = load_hardware_file(HARDWARE / "pcie-4gpu-nvlink-pairs.yaml")
    assert inv.topology is None and all(g.numa_node is None for g in inv.gpus)
    topo = load_hardware_file(HARDWARE / "pcie-8gpu-bridged-2socket.yaml").topology
    assert topo.link(0, 1).tier == "NV" and topo.link(0, 2).tier == "NODE" and topo.link(3, 4).tier == "SYS"
