"""Operators' intent: cordons and replica drains, made durable in the store before they take effect.

No agent can report intent back and no fleet state contradicts it, so it
is what the store keeps across restarts and failovers: a node registering
after one gets its stored cordon before the first pass places anything,
and a stored drain is issued again once its replica is reported.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from llmgw.controlplane.noderecord import NodeRecord
from llmgw.controlplane.reconciler import Reconciler
from llmgw.controlplane.store import ControlPlaneStore

log = logging.getLogger("llmgw.controlplane")


class OperatorIntent:
    def __init__(self, store: ControlPlaneStore, reconciler: Reconciler, nodes: Mapping[str, NodeRecord],
                 clock: Callable[[], float], changed: Callable[[], None]):
        self._store, self._reconciler, self._nodes = store, reconciler, nodes
        self._clock, self._changed = clock, changed

    def cordon(self, node_id: str, state: str | None) -> str | None:
        """Set a node's cordon (None, "cordoned", "draining"); returns the previous one.

        KeyError: a node that has not registered and has no stored cordon (one
        kept from before a restart can be lifted before its node is back).
        StoreError: the cordon could not be made durable; nothing changed.
        """
        rec = self._nodes.get(node_id)
        if rec is None and self._store.cordon_of(node_id) is None:
            raise KeyError(node_id)
        old = rec.cordon if rec is not None else self._store.cordon_of(node_id)
        self._store.set_cordon(node_id, state)
        if rec is not None:
            rec.cordon = state
        if old != state:
            log.info("node %s: %s by an operator", node_id, state or "uncordoned")
            self._changed()
        return old

    def drain(self, replica_id: str) -> None:
        """An operator drains a replica. KeyError, ValueError: see ``Reconciler.drain``; StoreError: nothing changed."""
        r = self._reconciler.book.replicas.get(replica_id)
        if r is None:
            raise KeyError(replica_id)
        if r.retired:
            raise ValueError(f"replica {replica_id} is already {r.state.value}")
        self._store.add_drain(replica_id)
        self._reconciler.drain(replica_id, self._clock())
        log.info("%s: drain requested", replica_id)
        self._changed()

    def refresh_cordons(self) -> None:
        """Every known node's cordon as the store says now (a previous leader may have changed it)."""
        for node_id, rec in self._nodes.items():
            rec.cordon = self._store.cordon_of(node_id)

    def resume_drains(self, in_grace: bool) -> bool:
        """Replica drains kept from before a restart: drain each again once its replica is back.

        One whose replica is not in the book after the startup grace has
        finished (or its node never came back) and is forgotten.  True when
        a drain was issued again.
        """
        book, gone, resumed = self._reconciler.book, set(), False
        for rid in self._store.intent.drains:
            r = book.replicas.get(rid)
            if r is None:
                if not in_grace:
                    gone.add(rid)
            elif not r.retired:
                self._reconciler.drain(rid, self._clock())
                log.info("%s: draining again (drained by an operator before a restart)", rid)
                resumed = True
        if gone:
            try:
                self._store.forget_drains(gone)
            except Exception as e:  # retried on the next pass; nothing is lost by keeping them
                log.warning("cannot forget finished drains in %s: %s", self._store.backend.where, e)
        return resumed
