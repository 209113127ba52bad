"""Placement inputs and outputs.

Placement is pure: it takes what the fleet has (``NodeCapacity``) and what a
replica needs (``PlacementRequest``) and returns either a ``Placement`` or the
reasons, node by node, why there is none.  Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmgw.catalog import Model, Profile
from llmgw.hardware.types import HardwareInventory


@dataclass(frozen=True)
class NodeCapacity:
    inventory: HardwareInventory
    free_gpus: frozenset[int]
    schedulable: bool = True
    reason: str | None = None  # why not schedulable (unreachable, draining, ...)

    @property
    def node_id(self) -> str:
        return self.inventory.node_id


@dataclass(frozen=True)
class PlacementRequest:
    model: Model
    profile: Profile
    # Bytes of weights when known: the declared size, or the size of a local or
    # remote weights file.  None means unknown: the memory check is skipped and
    # the placement says so.
    weights_bytes: int | None = None
    # Extra share of the weights' size the group must hold on top (KV cache,
    # activations).  0.2 means the GPUs need 1.2x the weights.
    memory_headroom: float = 0.2


@dataclass(frozen=True)
class ShardPlan:
    node_id: str
    rank: int  # node rank within the replica; rank 0 serves HTTP
    gpu_indices: tuple[int, ...]
    # Environment placement decides (NCCL_IB_HCA, NCCL_SOCKET_IFNAME...).
    # CUDA_VISIBLE_DEVICES is the engine adapter's job, from gpu_indices.
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Placement:
    shards: tuple[ShardPlan, ...]
    rule: str  # "nvlink" | "lowest-free" | "multi-node"
    detail: str  # one human sentence: which GPUs, why
    fabric: str | None = None
    fabric_rate_gbps: float | None = None

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(s.node_id for s in self.shards)


@dataclass(frozen=True)
class NodeVerdict:
    node_id: str
    ok: bool
    reason: str


@dataclass(frozen=True)
class PlacementResult:
    placement: Placement | None
    verdicts: tuple[NodeVerdict, ...] = ()
    reason: str | None = None  # overall reason when placement is None

    @property
    def ok(self) -> bool:
        return self.placement is not None
