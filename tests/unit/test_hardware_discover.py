"""discover(): NVML or a hardware file for GPUs, the file or sysfs for adapters,
declared fabrics checked and their problems logged."""

from __future__ import annotations

import logging
from pathlib import Path

import pynvml
import pytest
import yaml

import llmgw.hardware as hardware
from llmgw.config import ConfigInvalid, schema_errors
from llmgw.hardware import infiniband
from llmgw.hardware import nvml as nvml_mod
from llmgw.hardware.discover import discover
from llmgw.hardware.types import FabricDeclaration

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
IB_A = FabricDeclaration("ib-a", ("mlx5_0", "mlx5_1"))


def sysfs(case: str) -> Path:
    return FIXTURES / "sysfs" / case / "class" / "infiniband"


class NoLibrary:
    """The bindings on a host without the driver: nvmlInit cannot load libnvidia-ml."""

    def __getattr__(self, name):
        if name.startswith(("NVML_", "NVMLError")):
            return getattr(pynvml, name)
        raise AttributeError(name)

    def nvmlInit(self):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)


@pytest.fixture(autouse=True)
def _fresh_warnings():
    infiniband._reset_logged()
    nvml_mod._reset_warnings()
    yield
    infiniband._reset_logged()
    nvml_mod._reset_warnings()


def test_package_exports_the_function():
    assert hardware.discover is discover and callable(hardware.discover)


def test_nvml_node_without_driver_still_validates_fabrics(caplog):
    caplog.set_level(logging.WARNING)
    inv = discover("gpu-01", gpu_source="nvml", sysfs_root=sysfs("port_init"), fabrics=[IB_A], nvml=NoLibrary())
    assert inv.node_id == "gpu-01" and inv.gpu_source == "nvml"
    assert inv.gpus == () and "libnvidia-ml.so.1" in inv.gpu_reason and not inv.nvlink_known
    assert [h.name for h in inv.hcas] == ["mlx5_0", "mlx5_1"]
    (fabric,) = inv.fabrics
    assert fabric.advertised_hcas == ("mlx5_0",)
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"0 GPUs: {inv.gpu_reason}" in messages
    assert any(m.startswith("fabric ib-a: mlx5_1: no ACTIVE port (port 1: INIT, phys LinkUp)") for m in messages)
    assert schema_errors(inv.to_dict(), "hardware") == []


def test_renamed_adapter_reported_as_undeclared():
    inv = discover("gpu-01", sysfs_root=sysfs("renamed"), fabrics=[IB_A], nvml=NoLibrary())
    assert inv.undeclared_hcas == ("mlx5_2",)
    assert inv.fabrics[0].problems == ("mlx5_0: absent (found: mlx5_1, mlx5_2)",)


def test_simulated_file_with_hcas_ignores_sysfs():
    inv = discover("gpu-ib-a-01", gpu_source="simulated", hardware_file=FIXTURES / "hardware" / "ib-a-node1.yaml",
                   sysfs_root=sysfs("port_down"), fabrics=[IB_A])
    assert inv.gpu_source == "simulated" and len(inv.gpus) == 4
    assert inv.fabrics[0].advertised_hcas == ("mlx5_0", "mlx5_1")


def test_simulated_file_without_hcas_reads_sysfs(tmp_path, caplog):
    doc = yaml.safe_load((FIXTURES / "hardware" / "hgx-h100-8gpu.yaml").read_text())
    del doc["hcas"], doc["fabrics"], doc["undeclared_hcas"]
    path = tmp_path / "hw.yaml"
    path.write_text(yaml.safe_dump(doc))
    caplog.set_level(logging.WARNING)
    inv = discover("node-7", gpu_source="simulated", hardware_file=path,
                   sysfs_root=sysfs("missing_adapter"), fabrics=[IB_A])
    assert inv.node_id == "node-7" and len(inv.gpus) == 8
    assert [h.name for h in inv.hcas] == ["mlx5_0"]
    assert inv.fabrics[0].problems == ("mlx5_1: absent (found: mlx5_0)",)
    assert "fabric ib-a: mlx5_1: absent (found: mlx5_0)" in [r.getMessage() for r in caplog.records]
    # No declaration at all: every adapter found is undeclared.
    bare = discover("node-7", gpu_source="simulated", hardware_file=path, sysfs_root=sysfs("healthy"))
    assert bare.fabrics == () and bare.undeclared_hcas == ("mlx5_0", "mlx5_1")


def test_configuration_errors_raise(tmp_path):
    with pytest.raises(ValueError, match="needs a hardware_file"):
        discover("n", gpu_source="simulated")
    with pytest.raises(ValueError, match="gpu_source must be one of nvml, simulated"):
        discover("n", gpu_source="cuda")  # type: ignore[arg-type]
    bad = tmp_path / "hw.yaml"
    bad.write_text("node_id: n\ngpu_source: simulated\ngpus: [{index: 0}]\n")
    with pytest.raises(ConfigInvalid) as excinfo:
        discover("n", gpu_source="simulated", hardware_file=bad)
    assert {e.pointer for e in excinfo.value.errors} == {"/gpus/0"}


# --- adapters found but in no declared fabric: logged on the node, once ---------------------


def undeclared_lines(caplog):
    return [r for r in caplog.records if "in no declared fabric" in r.getMessage()]


def test_renamed_adapter_is_logged_once_naming_it(caplog):
    caplog.set_level(logging.INFO, logger="llmgw.hardware")
    inv = discover("gpu-01", sysfs_root=sysfs("renamed"), fabrics=[IB_A], nvml=NoLibrary())
    assert inv.undeclared_hcas == ("mlx5_2",)
    (record,) = undeclared_lines(caplog)
    assert record.levelno == logging.INFO
    assert "mlx5_2" in record.getMessage() and "fabric membership is configuration" in record.getMessage()
    discover("gpu-01", sysfs_root=sysfs("renamed"), fabrics=[IB_A], nvml=NoLibrary())  # a reconnect rediscovers
    assert len(undeclared_lines(caplog)) == 1


def test_declared_adapters_are_not_logged_as_undeclared(caplog):
    caplog.set_level(logging.INFO, logger="llmgw.hardware")
    discover("gpu-01", sysfs_root=sysfs("healthy"), fabrics=[IB_A], nvml=NoLibrary())
    assert undeclared_lines(caplog) == []
