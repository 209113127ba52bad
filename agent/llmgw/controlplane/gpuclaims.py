"""One GPU, one node: a registration presenting another node's GPU UUIDs is refused.

GPU UUIDs are burnt into the card; two live nodes reporting the same one
means one of them is lying (or copied the other's inventory), and placement
would otherwise hand the same physical GPU out twice.  A node already
declared lost does not hold its GPUs any more: the card may have moved.

Indexed by UUID so a registration costs a lookup per GPU, not a walk of the
fleet (thousands of nodes register at once after a control-plane restart).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


def uuids_of(hardware: Mapping[str, Any]) -> set[str]:
    """The GPU UUIDs an inventory document (``register``'s ``hardware``) lists."""
    return {str(g["uuid"]) for g in hardware.get("gpus", ()) if isinstance(g, Mapping) and g.get("uuid")}


class GpuOwners:
    """Which node presented each GPU UUID last."""

    def __init__(self) -> None:
        self._owner: dict[str, str] = {}
        self._held: dict[str, set[str]] = {}

    def problem(self, node_id: str, hardware: Mapping[str, Any], holds: Callable[[str], bool]) -> str | None:
        """Why ``node_id`` may not present ``hardware``, or None.

        ``holds(other)``: whether that node still holds its GPUs (known and not lost).
        """
        shared: dict[str, list[str]] = {}
        for u in sorted(uuids_of(hardware)):
            other = self._owner.get(u)
            if other is not None and other != node_id and holds(other):
                shared.setdefault(other, []).append(u)
        if not shared:
            return None
        other, uuids = next(iter(sorted(shared.items())))
        more = f" and {len(uuids) - 3} more" if len(uuids) > 3 else ""
        return (f"node {node_id} presents GPU UUID(s) {', '.join(uuids[:3])}{more} that node {other} already "
                "holds: one GPU cannot be on two nodes")

    def record(self, node_id: str, hardware: Mapping[str, Any]) -> None:
        """``node_id`` now holds exactly the GPUs of ``hardware``."""
        for u in self._held.pop(node_id, set()):
            if self._owner.get(u) == node_id:
                del self._owner[u]
        mine = uuids_of(hardware)
        self._held[node_id] = mine
        for u in mine:
            self._owner[u] = node_id
