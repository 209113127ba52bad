"""An adapter found but in no declared fabric is logged on the node, once."""

import logging
from pathlib import Path

import pynvml
import pytest

from llmgw.hardware import infiniband
from llmgw.hardware import nvml as nvml_mod
from llmgw.hardware.discover import discover
from llmgw.hardware.types import FabricDeclaration

SYSFS = Path(__file__).resolve().parents[1] / "fixtures" / "sysfs"
IB_A = FabricDeclaration("ib-a", ("mlx5_0", "mlx5_1"))


class NoNvml:
    """The bindings on a host without the driver: discover() reports 0 GPUs and goes on."""

    def __getattr__(self, name):
        if name.startswith(("NVML_", "NVMLError")):
            return getattr(pynvml, name)
        raise AttributeError(name)

    def nvmlInit(self):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)


@pytest.fixture(autouse=True)
def _fresh_logs():
    infiniband._reset_logged()
    nvml_mod._reset_warnings()
    yield
    infiniband._reset_logged()
    nvml_mod._reset_warnings()


def undeclared_lines(caplog):
    return [r for r in caplog.records if "in no declared fabric" in r.getMessage()]


def test_renamed_adapter_is_logged_once_naming_it(caplog):
    caplog.set_level(logging.INFO, logger="llmgw.hardware")
    root = SYSFS / "renamed" / "class" / "infiniband"
    inv = discover("gpu-01", sysfs_root=root, fabrics=[IB_A], nvml=NoNvml())
    assert inv.undeclared_hcas == ("mlx5_2",)
    (record,) = undeclared_lines(caplog)
    assert record.levelno == logging.INFO
    assert "mlx5_2" in record.getMessage() and "fabric membership is configuration" in record.getMessage()
    discover("gpu-01", sysfs_root=root, fabrics=[IB_A], nvml=NoNvml())  # a reconnect rediscovers
    assert len(undeclared_lines(caplog)) == 1


def test_declared_adapters_are_not_logged_as_undeclared(caplog):
    caplog.set_level(logging.INFO, logger="llmgw.hardware")
    discover("gpu-01", sysfs_root=SYSFS / "healthy" / "class" / "infiniband", fabrics=[IB_A], nvml=NoNvml())
    assert undeclared_lines(caplog) == []
