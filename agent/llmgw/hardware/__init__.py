"""Hardware discovery: GPUs (NVML or a simulated file), RDMA adapters (sysfs),
and declared fabrics checked against what is really there.

``discover`` is both a submodule and the function it defines; importing the
function here, after the submodule, makes ``llmgw.hardware.discover`` the
function for every importer.  The NVML bindings are only loaded when GPUs are
actually discovered.
"""

from __future__ import annotations

from llmgw.hardware.types import GPU, HCA, GPUProcess, FabricDeclaration, FabricStatus, HardwareInventory, IBPort
from llmgw.hardware.infiniband import read_hcas, validate_fabrics
from llmgw.hardware.nvml import discover_gpus
from llmgw.hardware.simulated import load_hardware_file
from llmgw.hardware.discover import discover  # noqa: E402  (must come last, see above)

__all__ = [
    "GPU",
    "GPUProcess",
    "HCA",
    "FabricDeclaration",
    "FabricStatus",
    "HardwareInventory",
    "IBPort",
    "discover",
    "discover_gpus",
    "load_hardware_file",
    "read_hcas",
    "validate_fabrics",
]
