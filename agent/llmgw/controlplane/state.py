"""The control plane's in-memory state and the loop that acts on it.

This is the glue between the stream (``agentservice``), the pure rules
(``lifecycle``, ``reconciler``) and the router's endpoint table.  It holds
nothing that survives a restart on purpose: nodes, epochs and replicas are
rebuilt from registrations.

Epochs: every registration gets a new, globally increasing epoch, and the
node's previous stream is closed.  Whatever arrives on a superseded stream
afterwards is dropped here, so a half-dead connection can never undo what
a newer one reported.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from llmgw.catalog import Catalog
from llmgw.controlplane.lifecycle import Evaluation, NodeClock, NodeState, ReplacementLimiter, evaluate, observe
from llmgw.controlplane.reconciler import Context, NodeView, Plan, Reconciler, endpoints
from llmgw.hardware.types import HardwareInventory
from llmgw.settings import ServerSettings

log = logging.getLogger("llmgw.controlplane")


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

    def view(self) -> NodeView:
        return NodeView(self.node_id, self.clock.state, self.connected, self.epoch, self.inventory, self.address)


@dataclass
class Loaded:
    """A catalog in force, with where it came from."""

    settings: ServerSettings
    source: str | None
    loaded_at: float = field(default_factory=time.time)


class ControlPlane:
    def __init__(self, settings: ServerSettings, source: str | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.loaded = Loaded(settings, source)
        self.clock = clock
        self.started_at = clock()
        self.started_wall = time.time()
        self.nodes: dict[str, NodeRecord] = {}
        self.sessions: dict[str, Session] = {}
        self.reconciler = Reconciler()
        self.limiter = ReplacementLimiter(settings.lifecycle.replacements_per_minute)
        self.evaluation = Evaluation()
        self.unplaced: dict[tuple[str, int], str] = {}
        self._epoch = 0
        self._kick = asyncio.Event()
        self._endpoint_listeners: list[Callable[[list[dict[str, Any]]], None]] = []
        self._last_endpoints: list[dict[str, Any]] | None = None
        self._last_unplaced_logged: dict[tuple[str, int], str] = {}
        self.reload_errors: list[str] = []

    # ------------------------------------------------------------------ access
    @property
    def settings(self) -> ServerSettings:
        return self.loaded.settings

    @property
    def catalog(self) -> Catalog:
        return self.loaded.settings.catalog

    def on_endpoints(self, listener: Callable[[list[dict[str, Any]]], None]) -> None:
        """Call ``listener`` with the rank-0 endpoint set whenever it changes (and now)."""
        self._endpoint_listeners.append(listener)
        listener(endpoints(self.reconciler.book, self.node_views()))

    def node_views(self) -> dict[str, NodeView]:
        return {n: rec.view() for n, rec in self.nodes.items()}

    def kick(self) -> None:
        self._kick.set()

    def is_current(self, node_id: str, epoch: int) -> bool:
        rec = self.nodes.get(node_id)
        return rec is not None and rec.epoch == epoch

    # ---------------------------------------------------------------- stream
    def register(self, msg: dict[str, Any], session: Session, peer: str | None = None,
                 certificate: dict[str, Any] | None = None) -> int:
        """A validated, identity-checked ``register``: open a new epoch for the node.

        ``certificate`` describes the client certificate the agent presented,
        so expiry can be checked on what is in use rather than on a file.
        """
        now = self.clock()
        node_id = msg["node_id"]
        self._epoch += 1
        epoch = self._epoch
        session.epoch = epoch
        old = self.sessions.get(node_id)
        self.sessions[node_id] = session
        if old is not None and old is not session:
            old.close(f"superseded by a newer registration (epoch {epoch})")
        inventory = HardwareInventory.from_dict(msg["hardware"])
        rec = self.nodes.get(node_id)
        if rec is None:
            rec = NodeRecord(node_id, inventory, NodeClock.seen(now), epoch)
            self.nodes[node_id] = rec
        else:
            _, tr = observe(node_id, rec.clock, now)
            if tr is not None:
                log.info("node %s: %s -> %s (%s)", node_id, tr.old.value, tr.new.value, tr.reason)
        rec.inventory, rec.epoch, rec.connected = inventory, epoch, True
        rec.address = msg.get("address") or rec.address
        rec.agent_version, rec.boot_id = msg["agent_version"], msg["boot_id"]
        rec.registered_at, rec.peer, rec.certificate = time.time(), peer, certificate
        rec.registrations += 1
        log.info("node %s registered (epoch %d, agent %s, %d GPUs, %d shard(s) reported)",
                 node_id, epoch, rec.agent_version, len(inventory.gpus), len(msg["shards"]))
        for line in self.reconciler.observe_register(node_id, msg["shards"], now):
            log.info("%s", line)
        self.kick()
        return epoch

    def message(self, node_id: str, epoch: int, msg: dict[str, Any]) -> bool:
        """A validated message after ``register``; False (and no effect) if its stream is superseded."""
        if not self.is_current(node_id, epoch):
            log.debug("node %s: dropping %s from superseded epoch %d", node_id, msg.get("type"), epoch)
            return False
        now = self.clock()
        rec = self.nodes[node_id]
        _, tr = observe(node_id, rec.clock, now)
        if tr is not None:
            log.info("node %s: %s -> %s (%s)", node_id, tr.old.value, tr.new.value, tr.reason)
            self.kick()
        kind = msg["type"]
        if kind == "shard_status":
            for line in self.reconciler.observe_status(node_id, msg, now):
                log.info("%s", line)
            self.kick()
        elif kind == "progress":
            self.reconciler.observe_progress(node_id, msg, now)
        return True

    def disconnected(self, node_id: str, epoch: int) -> None:
        rec = self.nodes.get(node_id)
        if rec is None or rec.epoch != epoch:
            return
        rec.connected = False
        self.sessions.pop(node_id, None)
        log.warning("node %s: stream closed (epoch %d); its engines keep serving", node_id, epoch)
        self.kick()

    # ---------------------------------------------------------------- actions
    def drain(self, replica_id: str) -> None:
        self.reconciler.drain(replica_id, self.clock())
        log.info("%s: drain requested", replica_id)
        self.kick()

    def apply_settings(self, settings: ServerSettings, source: str | None) -> None:
        """Put a reloaded, already validated ``server.yaml`` in force."""
        old = self.settings
        self.loaded = Loaded(settings, source)
        self.limiter.retune(settings.lifecycle.replacements_per_minute, self.clock())
        for what, a, b in (("api.listen", (old.api_host, old.api_port), (settings.api_host, settings.api_port)),
                           ("tls", old.tls, settings.tls), ("insecure_no_tls", old.insecure_no_tls, settings.insecure_no_tls),
                           ("router", old.router, settings.router)):
            if a != b:
                log.warning("reload: %s changed; it takes effect at the next restart", what)
        log.info("reload: catalog now %d model(s), %d profile(s), %d deployment(s)", len(settings.catalog.models),
                 len(settings.catalog.profiles), len(settings.catalog.deployments))
        self.kick()

    def tick(self) -> Plan:
        """One pass: lifecycle, reconcile, dispatch, endpoints."""
        now = self.clock()
        lc = self.settings.lifecycle
        clocks = {n: rec.clock for n, rec in self.nodes.items()}
        ev = evaluate(clocks, now, self.started_at, lc)
        if ev.hold_reason and ev.hold_reason != self.evaluation.hold_reason and ev.held:
            log.warning("not declaring %s lost: %s", ", ".join(ev.held), ev.hold_reason)
        self.evaluation = ev
        for tr in ev.transitions:
            self.nodes[tr.node_id].last_reason = tr.reason
            level = logging.ERROR if tr.new is NodeState.LOST else logging.WARNING
            log.log(level, "node %s: %s -> %s (%s)", tr.node_id, tr.old.value, tr.new.value, tr.reason)
        ctx = Context(restart=self.settings.restart, memory_headroom=self.settings.memory_headroom,
                      in_grace=ev.in_grace, damped=ev.damped, limiter=self.limiter)
        views = self.node_views()
        plan = self.reconciler.reconcile(self.catalog, views, now, ctx)
        for line in plan.events:
            log.info("%s", line)
        for key, why in plan.unplaced.items():
            if self._last_unplaced_logged.get(key) != why and not why.startswith("restarting in"):
                log.warning("%s#%d not placed: %s", key[0], key[1], why)
        self._last_unplaced_logged = dict(plan.unplaced)
        self.unplaced = plan.unplaced
        for action in plan.actions:
            session = self.sessions.get(action.node_id)
            if session is None or not session.send(action.message()):
                log.warning("%s for %s: node %s has no open stream; its next registration will settle it",
                            type(action).__name__.lower(), getattr(action, "shard_id", None) or
                            action.spec["shard_id"], action.node_id)  # type: ignore[union-attr]
        doubles = self.reconciler.book.double_claims()
        for node_id, gpu, ids in doubles:
            log.error("GPU %d on %s is held by more than one shard: %s", gpu, node_id, ", ".join(ids))
        self._publish_endpoints(views)
        return plan

    def _publish_endpoints(self, views: dict[str, NodeView]) -> None:
        eps = endpoints(self.reconciler.book, views)
        if eps == self._last_endpoints:
            return
        self._last_endpoints = eps
        log.info("router endpoints: %s", ", ".join(f"{e['model']}@{e['url']}{' (draining)' if e['draining'] else ''}"
                                                 for e in eps) or "none")
        for listener in self._endpoint_listeners:
            try:
                listener(eps)
            except Exception:
                log.exception("endpoint listener failed")

    async def run(self, interval: float | None = None) -> None:
        """Tick on every kick, and at least every ``interval`` seconds."""
        while True:
            period = interval or max(0.2, min(1.0, self.settings.lifecycle.heartbeat_interval / 2))
            try:
                await asyncio.wait_for(self._kick.wait(), timeout=period)
            except asyncio.TimeoutError:
                pass
            self._kick.clear()
            try:
                self.tick()
            except Exception:
                log.exception("reconcile pass failed; retrying on the next tick")
