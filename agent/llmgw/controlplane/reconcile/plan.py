"""What a reconcile pass reads (``NodeView``, ``Context``) and what it decides (``Plan``)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from llmgw.controlplane.lifecycle import NodeState, ReplacementLimiter
from llmgw.hardware.types import HardwareInventory
from llmgw.settings import RestartPolicy


@dataclass(frozen=True)
class NodeView:
    """One node as the reconciler needs it: its lifecycle state and stream."""

    node_id: str
    state: NodeState
    connected: bool
    epoch: int
    inventory: HardwareInventory
    address: str | None = None
    # What placement can see of the node without its identities
    # (``placement.shape.node_key``); nodes of one shape are interchangeable.
    # None: not known, the node is compared with no other.
    shape: Hashable = None
    # An operator's cordon: None, "cordoned" (nothing new is placed here) or
    # "draining" (cordoned, and its replicas are moved elsewhere one at a time).
    cordon: str | None = None

    @property
    def schedulable(self) -> bool:
        return self.state is NodeState.READY and self.connected


@dataclass(frozen=True)
class Start:
    node_id: str
    spec: dict[str, Any]

    def message(self) -> dict[str, Any]:
        return {"type": "start", "spec": self.spec}


@dataclass(frozen=True)
class Stop:
    node_id: str
    shard_id: str
    reason: str

    def message(self) -> dict[str, Any]:
        return {"type": "stop", "shard_id": self.shard_id, "reason": self.reason[:4096]}


@dataclass(frozen=True)
class Drain:
    node_id: str
    shard_id: str

    def message(self) -> dict[str, Any]:
        return {"type": "drain", "shard_id": self.shard_id}


Action = Start | Stop | Drain


@dataclass(frozen=True)
class Context:
    """What the lifecycle decided this pass, and the policies in force."""

    restart: RestartPolicy
    memory_headroom: float = 0.2
    in_grace: bool = False  # just started: wait for agents to report before placing
    damped: bool = False  # zone disruption: no replacement of lost nodes' replicas
    limiter: ReplacementLimiter | None = None
    # Sizes of model sources learned while running (a URL's length, an agent's
    # download total): placement checks memory against them when a model
    # declares no size_bytes.
    weight_sizes: Mapping[str, int] = field(default_factory=dict)
    # Sources whose size is being probed right now: their models wait for the
    # answer (bounded) rather than be placed without a memory check.
    sizing: frozenset[str] = frozenset()
    # Wall-clock time of this pass, stamped into the grants it issues (None: ``now``).
    wall: float | None = None
    # Autoscaled deployments' counts (deployment key -> replicas), in place of the declared ``replicas``.
    replica_counts: Mapping[str, int] = field(default_factory=dict)


@dataclass
class Plan:
    actions: list[Action] = field(default_factory=list)
    events: list[str] = field(default_factory=list)  # log lines: what was decided and why
    unplaced: dict[tuple[str, int], str] = field(default_factory=dict)  # (model/profile, slot) -> why not
    drain_blocked: dict[str, str] = field(default_factory=dict)  # draining node -> why its next move waits
