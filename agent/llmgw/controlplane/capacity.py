"""The fleet's free GPUs during one reconcile pass, for placement at fleet size.

Placement asks every node it is given the same question and breaks ties by
node id.  Two nodes with the same shape (``llmgw.placement.shape.node_key``:
GPUs, links, models, fabrics, everything placement sees but their
identities) and the same free GPUs give the same answer,
so among such interchangeable nodes only the lowest node ids can ever be
chosen.  ``FleetCapacity`` groups nodes into those classes and hands
placement one representative per class (``k`` for a replica spanning ``k``
nodes), which picks exactly what the whole fleet would, in time that grows
with the number of distinct classes rather than with the fleet.

When nothing fits, the reason must still speak for every node, so
``everyone`` gives the whole list; a pass asks it once per deployment at
most (once one slot of a deployment does not fit in a pass, none of its
later slots will: the pass only ever takes GPUs).
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass

from llmgw.controlplane.lifecycle import NodeState
from llmgw.placement import NodeCapacity, Placement, PlacementIndex, PlacementRequest, PlacementResult, place
from llmgw.placement.roles import Placed, place_paired


@dataclass(frozen=True)
class _Unit:
    """A node as the pass sees it: capacity and interchangeability class."""

    capacity: NodeCapacity
    key: tuple


def _reason(state: NodeState, connected: bool, cordon: str | None = None) -> str | None:
    if state is not NodeState.READY:
        return state.value
    if not connected:
        return "stream disconnected"
    if cordon:
        return f"{cordon} by an operator"
    return None


class FleetCapacity:
    """Free GPUs per node for one pass; ``take`` keeps it true as the pass places.

    Single-node requests go to a ``PlacementIndex`` (buckets of nodes by what
    they can offer, in order of preference); a replica spanning nodes is
    placed by ``place`` over the class representatives.
    """

    def __init__(self, units: Iterable[tuple[NodeCapacity, Hashable]]):
        self._units: dict[str, _Unit] = {}
        self._classes: dict[tuple, list[str]] = {}  # key -> node ids, sorted
        self._index: PlacementIndex | None = None  # built on the first single-node request
        for cap, shape in units:
            self._put(cap, shape)

    @classmethod
    def of(cls, claimed: Mapping[str, Iterable[int]] | None, nodes: Mapping[str, object]) -> "FleetCapacity":
        """From node views (``NodeView``-like) and the GPUs claimed on each node."""
        claimed = claimed or {}
        units = []
        for node_id in sorted(nodes):
            n = nodes[node_id]
            taken = claimed.get(node_id, ())
            free = frozenset(g.index for g in n.inventory.gpus if g.index not in taken)  # type: ignore[attr-defined]
            reason = _reason(n.state, n.connected, getattr(n, "cordon", None))  # type: ignore[attr-defined]
            cap = NodeCapacity(inventory=n.inventory, free_gpus=free,  # type: ignore[attr-defined]
                               schedulable=reason is None, reason=reason)
            units.append((cap, getattr(n, "shape", None)))
        return cls(units)

    def _put(self, cap: NodeCapacity, shape: Hashable) -> None:
        # An unknown shape (None, or an empty one): the node is a class of its own.
        key = (("shape", shape) if shape else ("node", cap.node_id), cap.free_gpus, cap.schedulable,
               cap.reason)
        self._units[cap.node_id] = _Unit(cap, key)
        bisect.insort(self._classes.setdefault(key, []), cap.node_id)

    def _drop(self, node_id: str) -> _Unit:
        unit = self._units.pop(node_id)
        members = self._classes[unit.key]
        del members[bisect.bisect_left(members, node_id)]
        if not members:
            del self._classes[unit.key]
        return unit

    def everyone(self) -> list[NodeCapacity]:
        """Every node, in node-id order."""
        return [self._units[n].capacity for n in sorted(self._units)]

    def candidates(self, per_class: int = 1) -> list[NodeCapacity]:
        """The ``per_class`` lowest node ids of each class, in node-id order."""
        ids = [n for members in self._classes.values() for n in members[:per_class]]
        return [self._units[n].capacity for n in sorted(ids)]

    def classes(self) -> int:
        return len(self._classes)

    def place(self, request: PlacementRequest) -> PlacementResult:
        """``place`` over the whole fleet, in time that does not grow with it.

        The answer (node and GPUs) is the one ``place`` gives over every
        node.  A refusal of a multi-node replica is asked of every node, so
        it says why each one cannot; a single-node refusal is the index's
        summary, counted per kind of reason.
        """
        if request.profile.nodes == 1:
            if self._index is None:  # capacities() and multi-node passes never need it
                self._index = PlacementIndex(self.everyone())
            return self._index.place(request)
        result = place(request, self.candidates(per_class=max(1, request.profile.nodes)))
        if result.placement is None:
            result = place(request, self.everyone())
        return result

    def place_paired(self, request: PlacementRequest, placed: Placed) -> PlacementResult:
        """``place`` for one replica of a prefill/decode group (``placement.roles``): over every node,
        since which nodes can host it depends on where its peers run, which no class records."""
        if request.profile.kv_transfer is None:
            return self.place(request)
        return place_paired(request, self.everyone(), placed)

    def take(self, placement: Placement) -> None:
        """The GPUs of ``placement`` are no longer free."""
        if self._index is not None:
            self._index.take(placement)
        for shard in placement.shards:
            unit = self._drop(shard.node_id)
            cap = unit.capacity
            shape = unit.key[0][1] if unit.key[0][0] == "shape" else None
            self._put(NodeCapacity(inventory=cap.inventory, free_gpus=cap.free_gpus - frozenset(shard.gpu_indices),
                                   schedulable=cap.schedulable, reason=cap.reason), shape)
