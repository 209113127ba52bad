"""One node's hardware inventory: GPUs, adapters, and declared fabrics checked.

GPUs come from NVML or, for tests and demos, a hardware file
(``llmgw.hardware.simulated``).  Adapters come from the file when it lists
``hcas``, else from sysfs, so a simulated node can still validate real
adapters.  Declared fabrics are always checked against the adapters that
were found, and each problem, and each adapter no fabric declares, is logged
here, on the node.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from llmgw.hardware.infiniband import (
    DEFAULT_SYSFS_ROOT,
    log_fabric_problems,
    log_undeclared,
    read_hcas,
    validate_fabrics,
)
from llmgw.hardware.nvml import discover_gpus
from llmgw.hardware.simulated import inventory_from_document, read_hardware_document
from llmgw.hardware.types import FabricDeclaration, HardwareInventory

log = logging.getLogger(__name__)

GPU_SOURCES = ("nvml", "simulated")


def discover(
    node_id: str,
    *,
    gpu_source: Literal["nvml", "simulated"] = "nvml",
    hardware_file: str | Path | None = None,
    sysfs_root: str | Path = DEFAULT_SYSFS_ROOT,
    fabrics: Sequence[FabricDeclaration] = (),
    nvml: Any = None,
) -> HardwareInventory:
    """Discover this node's hardware.

    Never raises for what the hardware says (no driver, missing adapters,
    unreadable sysfs: all become reasons in the inventory).  A bad
    ``hardware_file`` raises ``llmgw.config.ConfigInvalid``, and a bad
    ``gpu_source`` ``ValueError``: those are configuration, which must stop
    the agent before it advertises anything.  ``nvml`` replaces the
    ``pynvml`` module (tests).
    """
    if gpu_source not in GPU_SOURCES:
        raise ValueError(f"gpu_source must be one of {', '.join(GPU_SOURCES)}, got {gpu_source!r}")
    if gpu_source == "simulated":
        if hardware_file is None:
            raise ValueError("gpu_source 'simulated' needs a hardware_file")
        inv = _simulated(node_id, Path(hardware_file), Path(sysfs_root), fabrics)
    else:
        # The class root is <sys>/class/infiniband; GPUs' PCI paths are under <sys>/bus/pci.
        found = discover_gpus(nvml, sys_root=Path(sysfs_root).parent.parent)
        hcas = read_hcas(sysfs_root)
        statuses, undeclared = validate_fabrics(fabrics, hcas)
        inv = HardwareInventory(
            node_id=node_id,
            gpus=found.gpus,
            hcas=hcas,
            fabrics=statuses,
            undeclared_hcas=undeclared,
            gpu_source="nvml",
            gpu_reason=found.reason,
            nvlink_known=found.nvlink_known,
            topology=found.topology,
        )
    log_fabric_problems(inv.fabrics)
    log_undeclared(inv.undeclared_hcas)
    return inv


def _simulated(
    node_id: str, path: Path, sysfs_root: Path, fabrics: Sequence[FabricDeclaration]
) -> HardwareInventory:
    doc = read_hardware_document(path)
    inv = inventory_from_document(doc, node_id=node_id, fabrics=fabrics)
    if "hcas" not in doc:
        hcas = read_hcas(sysfs_root)
        statuses, undeclared = validate_fabrics(fabrics, hcas)
        inv = dataclasses.replace(inv, hcas=hcas, fabrics=statuses, undeclared_hcas=undeclared)
    return inv
