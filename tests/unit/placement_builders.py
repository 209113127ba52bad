"""Hardware and request builders shared by the placement tests (no tests here).

Shapes are real ones: an 8x H100 80GB SXM board behind NVSwitch (every GPU an
NVLink peer of every other), a 4-GPU PCIe box whose bridges pair (0,1) and
(2,3), and fabric statuses as the agent reports them after comparing declared
adapters with sysfs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from llmgw.catalog import Model, Profile
from llmgw.hardware.types import GPU, HCA, FabricStatus, HardwareInventory, IBPort
from llmgw.placement import NodeCapacity, PlacementRequest

GIB = 1 << 30
H100_80GB = 80 * GIB


def gpu(
    index: int, peers: Iterable[int] = (), memory_bytes: int = H100_80GB, name: str = "NVIDIA H100 80GB HBM3"
) -> GPU:
    return GPU(
        index=index,
        uuid=f"GPU-{index:08x}-0000-0000-0000-000000000000",
        name=name,
        memory_bytes=memory_bytes,
        pci_bus_id=f"00000000:{0x18 + index * 0x10:02X}:00.0",
        nvlink_peers=tuple(sorted(peers)),
    )


def inventory(
    node_id: str,
    count: int,
    peers: Callable[[int], Iterable[int]] = lambda i: (),
    memory_bytes: int | Callable[[int], int] = H100_80GB,
    fabrics: tuple[FabricStatus, ...] = (),
    nvlink_known: bool = True,
    name: str = "NVIDIA H100 80GB HBM3",
) -> HardwareInventory:
    mem = memory_bytes if callable(memory_bytes) else (lambda i: memory_bytes)
    return HardwareInventory(
        node_id=node_id,
        gpus=tuple(gpu(i, peers(i), mem(i), name) for i in range(count)),
        hcas=tuple(_hca(h, f) for f in fabrics for h in f.declared_hcas),
        fabrics=fabrics,
        gpu_source="simulated",
        nvlink_known=nvlink_known,
    )


def _hca(name: str, f: FabricStatus) -> HCA:
    active = name in f.advertised_hcas
    rate = f.rate_gbps or 400.0
    return HCA(
        name=name,
        ports=(
            IBPort(
                port=1,
                state="ACTIVE" if active else "INIT",
                phys_state="LinkUp",
                rate_gbps=rate,
                rate_text=f"{rate:g} Gb/sec (4X NDR)",
                link_layer="InfiniBand",
            ),
        ),
    )


def nvswitch_h100(node_id: str, fabrics: tuple[FabricStatus, ...] = ()) -> HardwareInventory:
    """8x H100 SXM on NVSwitch: every GPU reaches every other over NVLink."""
    return inventory(node_id, 8, peers=lambda i: [j for j in range(8) if j != i], fabrics=fabrics)


def pcie_pairs(node_id: str, fabrics: tuple[FabricStatus, ...] = ()) -> HardwareInventory:
    """4x A100 80GB PCIe with NVLink bridges pairing (0,1) and (2,3)."""
    return inventory(node_id, 4, peers=lambda i: [i ^ 1], fabrics=fabrics, name="NVIDIA A100 80GB PCIe")


def good_fabric(
    name: str = "ib-a", hcas: tuple[str, ...] = ("mlx5_0", "mlx5_1"), rate: float | None = 400.0
) -> FabricStatus:
    return FabricStatus(name=name, declared_hcas=hcas, advertised_hcas=hcas, rate_gbps=rate)


def degraded_fabric(name: str = "ib-a", rate: float = 200.0) -> FabricStatus:
    """mlx5_0 ACTIVE, mlx5_1 physically up but no subnet manager (INIT)."""
    return FabricStatus(
        name=name,
        declared_hcas=("mlx5_0", "mlx5_1"),
        advertised_hcas=("mlx5_0",),
        rate_gbps=rate,
        problems=("mlx5_1: no ACTIVE port (port 1: INIT, LinkUp)",),
    )


def dead_fabric(name: str = "ib-a") -> FabricStatus:
    """Both declared adapters unusable: one missing, one with its port down."""
    return FabricStatus(
        name=name,
        declared_hcas=("mlx5_0", "mlx5_1"),
        advertised_hcas=(),
        rate_gbps=None,
        problems=("mlx5_0: not present on this node", "mlx5_1: no ACTIVE port (port 1: DOWN, Disabled)"),
    )


def cap(
    inv: HardwareInventory,
    free: Iterable[int] | None = None,
    schedulable: bool = True,
    reason: str | None = None,
) -> NodeCapacity:
    free_set = frozenset(g.index for g in inv.gpus) if free is None else frozenset(free)
    return NodeCapacity(inventory=inv, free_gpus=free_set, schedulable=schedulable, reason=reason)


def request(
    tp: int = 1,
    pp: int = 1,
    nodes: int = 1,
    weights_gib: float | None = None,
    headroom: float = 0.2,
    model: str = "llama-70b",
    profile: str | None = None,
) -> PlacementRequest:
    prof = Profile(
        name=profile or f"tp{tp}" + (f"-pp{pp}" if pp != 1 else "") + (f"-n{nodes}" if nodes != 1 else ""),
        engine="vllm",
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        nodes=nodes,
    )
    m = Model(name=model, source="/models/llama-70b", served_name=model)
    weights = None if weights_gib is None else int(weights_gib * GIB)
    return PlacementRequest(model=m, profile=prof, weights_bytes=weights, memory_headroom=headroom)


def with_tiers(inv: HardwareInventory, tier: Callable[[int, int], str | None],
               nvlinks: Callable[[int, int], int] = lambda a, b: 0) -> HardwareInventory:
    """``inv`` with a topology matrix: ``tier(a, b)`` for every pair (None: unknown).

    NVLink peers are set from the pairs whose tier is NV, as discovery does.
    """
    import dataclasses

    from llmgw.hardware.topology import GPULink, Topology

    idx = [g.index for g in inv.gpus]
    links = []
    peers: dict[int, list[int]] = {i: [] for i in idx}
    for i, a in enumerate(idx):
        for b in idx[i + 1:]:
            t = tier(a, b)
            links.append(GPULink((a, b), t, nvlinks(a, b) if t == "NV" else 0,
                                 None if t is not None else "NVML_ERROR_NOT_SUPPORTED"))
            if t == "NV":
                peers[a].append(b)
                peers[b].append(a)
    gpus = tuple(dataclasses.replace(g, nvlink_peers=tuple(sorted(peers[g.index]))) for g in inv.gpus)
    return dataclasses.replace(inv, gpus=gpus, topology=Topology(tuple(links)), nvlink_known=True)


def pcie8_two_sockets(node_id: str) -> HardwareInventory:
    """8-GPU PCIe box: bridges pair (0,1)(2,3)(4,5)(6,7); pairs NODE within a socket, SYS across."""
    def tier(a: int, b: int) -> str:
        if a // 2 == b // 2:
            return "NV"
        return "NODE" if a // 4 == b // 4 else "SYS"

    return with_tiers(inventory(node_id, 8, name="NVIDIA RTX A6000", memory_bytes=48 * GIB), tier,
                      lambda a, b: 4)
