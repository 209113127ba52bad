"""A node as the control plane keeps it, and the agent stream it is reached over."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Hashable, Protocol

from llmgw.controlplane.lifecycle import NodeClock
from llmgw.controlplane.reconciler import NodeView
from llmgw.hardware.advertise import advertise
from llmgw.hardware.types import HardwareInventory


def advertised(document: dict[str, Any]) -> HardwareInventory:
    """An agent's inventory as placement may use it: ``llmgw.hardware.advertise`` over it again.

    The agent already withheld its unfit GPUs; judging each GPU's ``health``
    here too means a GPU an older or faulty agent left in is not given out,
    and the control plane, the agent and ``ctl explain`` apply one rule.
    """
    return advertise(HardwareInventory.from_dict(document), now=time.time()).inventory


class Session(Protocol):
    """One agent's stream as the control plane uses it."""

    epoch: int

    def send(self, msg: dict[str, Any]) -> bool: ...

    def close(self, reason: str) -> None: ...


@dataclass
class NodeRecord:
    node_id: str
    inventory: HardwareInventory
    clock: NodeClock
    epoch: int
    connected: bool = True
    address: str | None = None
    agent_version: str = ""
    boot_id: str = ""
    registered_at: float = 0.0  # wall clock, for people
    registrations: int = 0
    peer: str | None = None
    certificate: dict[str, Any] | None = None  # what the agent presented: serial, not_after, fingerprint
    last_reason: str | None = None  # why it changed state last
    shape: Hashable = None  # placement.shape.node_key(inventory), computed once per registration
    cordon: str | None = None  # None, "cordoned" or "draining" (an operator's; kept across registrations and, in the store, restarts)
    _view: NodeView | None = field(default=None, repr=False, compare=False)

    def view(self) -> NodeView:
        """The reconciler's picture of this node; the same object while nothing in it changed."""
        v = self._view
        if (v is None or v.state is not self.clock.state or v.connected is not self.connected
                or v.epoch != self.epoch or v.inventory is not self.inventory or v.address != self.address
                or v.cordon != self.cordon):
            v = self._view = NodeView(self.node_id, self.clock.state, self.connected, self.epoch, self.inventory,
                                      self.address, self.shape, self.cordon)
        return v
