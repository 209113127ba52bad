"""The reconciler: from the catalog and what the fleet reports, what to do.

Pure and level-triggered.  Agent messages are *observations*
(``observe_register``, ``observe_status``, ``observe_progress``) that only
update the book; ``reconcile`` then looks at the whole picture and returns
the ``start``/``stop``/``drain`` messages to send.  Nothing here touches a
socket or a clock, so every rule is unit-tested with explicit times.

This module composes; the rules are the passes in ``controlplane/reconcile/``,
one concern each (adoption, losses, slots, rollout, failures and backoff,
progress, cleanup, placement, drains), run by ``reconcile`` in a fixed
order: what is lost or conflicting is retired first, failures are judged
before anything is stopped, stopping before placing, and placing missing
slots before moving replicas off draining nodes, so a drain's twin never
takes the room a missing slot needs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from llmgw.catalog import Catalog
from llmgw.controlplane.grants import GrantKeys
from llmgw.controlplane.reconcile import cleanup, failures, losses, observe, progress, replicacount, rollout, slots
from llmgw.controlplane.reconcile.cleanup import DRAIN_TIMEOUT
from llmgw.controlplane.reconcile.drain import drain_nodes
from llmgw.controlplane.reconcile.endpoints import endpoints
from llmgw.controlplane.reconcile.failures import backoff
from llmgw.controlplane.reconcile.observe import claim_of
from llmgw.controlplane.reconcile.placement import (Issuer, Room, capacities, fleet_capacity, place_missing,
                                                    placement_request)
from llmgw.controlplane.reconcile.plan import Action, Context, Drain, NodeView, Plan, Start, Stop
from llmgw.controlplane.reconcile.stopping import retire
from llmgw.controlplane.replicas import Replica, ReplicaBook

# What callers have always imported from here; the definitions live in the passes.
__all__ = ["DRAIN_TIMEOUT", "Action", "Context", "Drain", "NodeView", "Plan", "Reconciler", "Start", "Stop",
           "backoff", "capacities", "claim_of", "endpoints", "fleet_capacity", "placement_request"]


class Reconciler:
    """Holds the book; observations mutate it, ``reconcile`` decides.

    ``keys`` sign the grants of every shard placed here and verify those
    reported back; ``cp_epoch`` names this control-plane run in them.
    """

    def __init__(self, book: ReplicaBook | None = None, rand: Callable[[], str] | None = None,
                 keys: GrantKeys | None = None, cp_epoch: int = 0):
        self.book = book or ReplicaBook()
        self._rand = rand
        self.keys = keys or GrantKeys.fresh()
        self.cp_epoch = cp_epoch

    # ------------------------------------------------------------ observations

    def observe_register(self, node_id: str, reports: list[dict[str, Any]], now: float,
                         refused: list[str] | None = None) -> list[str]:
        """A node registered and listed every shard it runs (``reconcile.observe``)."""
        return observe.observe_register(self.book, self.keys, node_id, reports, now, refused)

    def observe_status(self, node_id: str, msg: dict[str, Any], now: float) -> list[str]:
        """A shard changed state on ``node_id`` (only shards of that node count)."""
        return observe.observe_status(self.book, node_id, msg, now)

    def observe_progress(self, node_id: str, msg: dict[str, Any], now: float) -> None:
        """Download progress: shown under the shards waiting on it, never a transition."""
        observe.observe_progress(self.book, node_id, msg, now)

    # ---------------------------------------------------------- operators' asks

    def drain(self, replica_id: str, now: float) -> Replica:
        """An operator drains a replica: it leaves the router, finishes, stops, and is replaced."""
        r = self.book.replicas.get(replica_id)
        if r is None:
            raise KeyError(replica_id)
        if r.retired:
            raise ValueError(f"replica {replica_id} is already {r.state.value}")
        retire(r, "drained by an operator", now, draining=True)
        return r

    def mark_sick(self, replica_id: str, reason: str) -> bool:
        """A Ready replica judged sick from outside its shards' states: replace it, make before break.

        True when this is news.  The move itself is the drain pass's
        (``reconcile.drain``), as for a replica on a draining node: a twin
        first, the old one drained once the twin is Ready.
        """
        r = self.book.replicas.get(replica_id)
        if r is None or r.retired or r.failed_at is not None or r.sick is not None:
            return False
        r.sick = reason
        return True

    # --------------------------------------------------------------- decisions

    def reconcile(self, catalog: Catalog, nodes: Mapping[str, NodeView], now: float, ctx: Context) -> Plan:
        """One pass over the whole fleet: each pass in turn, in this order."""
        book, plan = self.book, Plan()
        deployments = replicacount.deployments(catalog, ctx.replica_counts)
        issuer = Issuer(self.keys, self.cp_epoch, self._rand)
        losses.forget_lost_nodes(book, nodes, now)
        slots.resolve_double_claims(book, now, plan)
        rollout.retire_uncatalogued(book, catalog, now, plan)
        losses.retire_on_lost_nodes(book, nodes, now, plan)
        losses.retire_on_sick_gpus(book, nodes, now, plan)
        for dep in deployments:
            slots.assign_slots(book, dep, now, plan)
        for r in list(book.live()):
            failures.check_failures(book, r, now, ctx, plan)
        for r in list(book.live()):
            if r.failed_at is not None:
                failures.stop_failed(book, r, nodes, now, plan)
            else:
                progress.advance(book, r, nodes, now, plan)
        cleanup.clean_retired(book, nodes, now, plan)
        cleanup.clean_strays(book, nodes, plan)
        room = Room(book, nodes)  # counted on first need: most passes place nothing
        for dep in deployments:
            place_missing(book, issuer, catalog, dep, now, ctx, plan, room)
        drain_nodes(book, issuer, catalog, nodes, now, ctx, plan, room)
        return plan
