"""The nodes and their agents' streams: what a registration, a message, a ping or a close changes.

Every registration gets a new, globally increasing epoch (from the store,
so it increases across restarts too when the store is durable), and the
node's previous stream is closed.  Whatever arrives on a superseded stream
afterwards is dropped here, so a half-dead connection can never undo what
a newer one reported.  What agents report goes to the reconciler's book as
observations; ``changed`` is called whenever a whole pass should look again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from llmgw.controlplane.lifecycle import NodeClock, NodeState, Transition, half_open, observe
from llmgw.controlplane.noderecord import NodeRecord, Session, advertised
from llmgw.controlplane.reconciler import Action, NodeView, Reconciler
from llmgw.controlplane.store import ControlPlaneStore
from llmgw.placement.shape import node_key
from llmgw.settings import Lifecycle

log = logging.getLogger("llmgw.controlplane")


class NodeStreams:
    """Nodes by id and their current streams.

    ``grown`` is told the number of nodes after each registration (the
    lifecycle timings stretch with the fleet); ``progress`` gets every
    download ``progress`` message after the book has.
    """

    def __init__(self, clock: Callable[[], float], store: ControlPlaneStore, reconciler: Reconciler,
                 changed: Callable[[], None], grown: Callable[[int], None],
                 progress: Callable[[str, dict[str, Any]], None]):
        self.nodes: dict[str, NodeRecord] = {}
        self.sessions: dict[str, Session] = {}
        self._clock, self._store, self._reconciler = clock, store, reconciler
        self._changed, self._grown, self._progress = changed, grown, progress
        self._half_open_checked = float("-inf")
        self.keepalive_frames = 0  # pings and pongs read on current streams (heartbeats stand in for most)

    def views(self) -> dict[str, NodeView]:
        return {n: rec.view() for n, rec in self.nodes.items()}

    def is_current(self, node_id: str, epoch: int) -> bool:
        rec = self.nodes.get(node_id)
        return rec is not None and rec.epoch == epoch

    def is_open(self, node_id: str, epoch: int) -> bool:
        """``is_current``, and the stream still open (a closed one says nothing more)."""
        rec = self.nodes.get(node_id)
        return rec is not None and rec.epoch == epoch and rec.connected

    def register(self, msg: dict[str, Any], session: Session, peer: str | None = None,
                 certificate: dict[str, Any] | None = None) -> int:
        """A validated, identity-checked ``register``: open a new epoch for the node.

        ``certificate`` describes the client certificate the agent presented,
        so expiry can be checked on what is in use rather than on a file.
        """
        now = self._clock()
        node_id = msg["node_id"]
        epoch = self._store.next_epoch()  # first: a StoreError refuses this registration and changes nothing
        session.epoch = epoch
        old = self.sessions.get(node_id)
        self.sessions[node_id] = session
        if old is not None and old is not session:
            old.close(f"superseded by a newer registration (epoch {epoch})")
        inventory = advertised(msg["hardware"])
        rec = self.nodes.get(node_id)
        if rec is None:
            rec = NodeRecord(node_id, inventory, NodeClock.seen(now), epoch, cordon=self._store.cordon_of(node_id))
            self.nodes[node_id] = rec
        else:
            _, tr = observe(node_id, rec.clock, now)
            if tr is not None:
                log.info("node %s: %s -> %s (%s)", node_id, tr.old.value, tr.new.value, tr.reason)
        rec.inventory, rec.epoch, rec.connected = inventory, epoch, True
        rec.shape = node_key(inventory)
        rec.address = msg.get("address") or rec.address
        rec.agent_version, rec.boot_id = msg["agent_version"], msg["boot_id"]
        rec.registered_at, rec.peer, rec.certificate = time.time(), peer, certificate
        rec.registrations += 1
        self._grown(len(self.nodes))
        log.info("node %s registered (epoch %d, agent %s, %d GPUs, %d shard(s) reported)",
                 node_id, epoch, rec.agent_version, len(inventory.gpus), len(msg["shards"]))
        refused: list[str] = []
        for line in self._reconciler.observe_register(node_id, msg["shards"], now, refused):
            log.log(logging.ERROR if line in refused else logging.INFO, "%s", line)
        self._changed()
        return epoch

    def message(self, node_id: str, epoch: int, msg: dict[str, Any]) -> bool:
        """A validated message after ``register``; False (and no effect) if its stream is superseded."""
        if not self.is_current(node_id, epoch):
            log.debug("node %s: dropping %s from superseded epoch %d", node_id, msg.get("type"), epoch)
            return False
        now = self._clock()
        rec = self.nodes[node_id]
        _, tr = observe(node_id, rec.clock, now)
        if tr is not None:
            log.info("node %s: %s -> %s (%s)", node_id, tr.old.value, tr.new.value, tr.reason)
            self._changed()
        kind = msg["type"]
        if kind == "shard_status":
            for line in self._reconciler.observe_status(node_id, msg, now):
                log.info("%s", line)
            self._changed()
        elif kind == "progress":
            self._reconciler.observe_progress(node_id, msg, now)
            self._progress(node_id, msg)
        elif kind == "hardware":
            inventory = advertised(msg["hardware"])
            log.warning("node %s: hardware changed while connected: %d GPU(s) advertised%s", node_id,
                        len(inventory.gpus), f" ({inventory.gpu_reason})" if inventory.gpu_reason else "")
            rec.inventory, rec.shape = inventory, node_key(inventory)
            self._changed()
        return True

    def frame(self, node_id: str, epoch: int) -> None:
        """A ping or pong on the node's current stream: the connection is alive (its silence is not reset)."""
        rec = self.nodes.get(node_id)
        if rec is not None and rec.epoch == epoch:
            rec.clock.last_frame = self._clock()
            self.keepalive_frames += 1

    def disconnected(self, node_id: str, epoch: int) -> None:
        rec = self.nodes.get(node_id)
        if rec is None or rec.epoch != epoch:
            return
        rec.connected = False
        self.sessions.pop(node_id, None)
        log.warning("node %s: stream closed (epoch %d); its engines keep serving", node_id, epoch)
        self._changed()

    def close_half_open(self, now: float, lc: Lifecycle) -> None:
        """Close the streams that carried nothing, not even a ping, for two ping intervals (at most twice a ping interval)."""
        if now - self._half_open_checked < lc.keepalive_interval / 2:
            return
        self._half_open_checked = now
        for node_id, rec in self.nodes.items():
            if rec.connected and half_open(rec.clock, now, lc):
                session = self.sessions.get(node_id)
                if session is not None:
                    session.close(f"nothing received for over {2 * lc.keepalive_interval:g}s, "
                                  "not even a ping: the connection is presumed dead")

    def note_transitions(self, transitions: Iterable[Transition]) -> None:
        """The lifecycle moved nodes: each keeps why, and it is logged (a lost node as an error)."""
        for tr in transitions:
            self.nodes[tr.node_id].last_reason = tr.reason
            level = logging.ERROR if tr.new is NodeState.LOST else logging.WARNING
            log.log(level, "node %s: %s -> %s (%s)", tr.node_id, tr.old.value, tr.new.value, tr.reason)

    def dispatch(self, actions: Iterable[Action], stamp: dict[str, Any]) -> None:
        """Send each action to its node's stream (with ``stamp``: the leader's term); one with none waits."""
        for action in actions:
            session = self.sessions.get(action.node_id)
            if session is None or not session.send({**action.message(), **stamp}):
                log.warning("%s for %s: node %s has no open stream; its next registration will settle it",
                            type(action).__name__.lower(), getattr(action, "shard_id", None) or
                            action.spec["shard_id"], action.node_id)  # type: ignore[union-attr]
