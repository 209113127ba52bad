"""The control plane's in-memory state and the loop that acts on it.

This is the glue between the stream (``agentservice``), the pure rules
(``lifecycle``, ``reconciler``) and the router's endpoint table.  Nodes and
replicas are rebuilt from registrations on purpose; only what no agent can
report back (operators' cordons and drains, the epoch reached) is kept in
the ``store`` (``controlplane/store.py``), written before it takes effect.

Epochs: every registration gets a new, globally increasing epoch (increasing
across restarts too, when the store is durable), and the node's previous
stream is closed.  Whatever arrives on a superseded stream
afterwards is dropped here, so a half-dead connection can never undo what
a newer one reported.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Hashable, Protocol

from llmgw import compat
from llmgw.catalog import Catalog
from llmgw.controlplane.ejections import EjectionBook, Verdict, held, judge
from llmgw.controlplane import grantsecret
from llmgw.controlplane.grants import GrantKeys
from llmgw.controlplane.lifecycle import (Evaluation, NodeClock, NodeState, ReplacementLimiter, evaluate, excuse,
                                          half_open, observe)
from llmgw.controlplane.looplag import LoopLag
from llmgw.controlplane.reconciler import Context, NodeView, Plan, Reconciler, endpoints
from llmgw.controlplane.replicas import ReplicaState
from llmgw.controlplane.sizing import WeightSizes
from llmgw.controlplane.store import ControlPlaneStore, MemoryBackend
from llmgw.hardware.advertise import advertise
from llmgw.hardware.types import HardwareInventory
from llmgw.placement.shape import node_key
from llmgw.settings import Lifecycle, ServerSettings, TLSFiles

log = logging.getLogger("llmgw.controlplane")


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


@dataclass
class Loaded:
    """A catalog in force, with where it came from."""

    settings: ServerSettings
    source: str | None
    loaded_at: float = field(default_factory=time.time)


FULL_PASS_EVERY = 30.0  # seconds: a settled fleet is still reconciled whole this often
STALL_EXCUSED_FROM = 0.25  # seconds of loop lateness, added up, before the nodes' deadlines are pushed back
PASS_SHARE = 0.5  # at most this share of the event loop goes to back-to-back reconcile passes


def _files(tls: TLSFiles | None) -> TLSFiles | None:
    """The TLS files a restart picks up (the revocation list is reloaded in place)."""
    return None if tls is None else dataclasses.replace(tls, revoked=None)


class ControlPlane:
    def __init__(self, settings: ServerSettings, source: str | None = None,
                 clock: Callable[[], float] = time.monotonic, keys: GrantKeys | None = None,
                 store: ControlPlaneStore | None = None):
        self.loaded = Loaded(settings, source)
        self.store = store or ControlPlaneStore(MemoryBackend())
        # With ``ha``: whether this process leads now (Elector.is_leader), and its term, stamped on
        # what it tells agents so that one deposed cannot be obeyed.  Without: always, and no stamp.
        self.authority: Callable[[], bool] = lambda: True
        self.leader_epoch = 0
        self.clock = clock
        self.started_at = clock()
        self.started_wall = time.time()
        self.nodes: dict[str, NodeRecord] = {}
        self.sessions: dict[str, Session] = {}
        self.reconciler = Reconciler(keys=keys, cp_epoch=self.store.epoch)
        self.limiter = ReplacementLimiter(settings.lifecycle.replacements_per_minute)
        self.evaluation = Evaluation()
        self.unplaced: dict[tuple[str, int], str] = {}
        self.drain_blocked: dict[str, str] = {}  # draining node(s) -> why the next move waits
        self.ejections = EjectionBook()  # routers' reports (POST /v1/router/ejections), rebuilt from re-sends
        self.ejection_verdicts: dict[str, Verdict] = {}  # replica -> the last judgement of its reports
        self.replaced_for_ejections = 0  # replicas judged sick from routers' reports (a counter)
        self.ejection_limiter = ReplacementLimiter(settings.router_ejections.replacements_per_minute)
        self._kick = asyncio.Event()
        self._endpoint_listeners: list[Callable[[list[dict[str, Any]]], None]] = []
        self._last_endpoints: list[dict[str, Any]] | None = None
        self._last_unplaced_logged: dict[tuple[str, str], list[int]] = {}
        self.reload_errors: list[str] = []
        self.sizes = WeightSizes(lambda: self.clock(), lambda: self.kick())  # placement waits on and reads these
        self._dirty = True  # something may have changed since the last whole-fleet pass
        self._settled = False  # the last pass left nothing to do
        self._last_full = float("-inf")
        self._fleet_size = 0  # the most nodes known at once: sizes the heartbeat interval
        self.looplag = LoopLag()  # this process's own stalls, not counted against agents (see tick)
        self.stalled = 0.0  # seconds of stall excused so far, for logs and tests
        self.stopping = False  # SIGTERM: no new stream is admitted, none registering is kept
        self._half_open_checked = float("-inf")
        self._stall_owed = 0.0  # loop lateness not yet excused (see _excuse_stall)

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
        """Something was observed: the next tick reconciles the whole fleet."""
        self._dirty = True
        self._kick.set()

    def lifecycle(self) -> Lifecycle:
        """The lifecycle timings in force: the configured ones, stretched for a large fleet.

        Sized by the most nodes this control plane has known at once (nodes
        are never forgotten while it runs), so a timing never shrinks below
        what a node was told when it registered.
        """
        return self.settings.lifecycle.for_fleet(self._fleet_size)

    def _grown_to(self, nodes: int) -> None:
        if nodes <= self._fleet_size:
            return
        before = self.lifecycle()
        self._fleet_size = nodes
        after = self.lifecycle()
        if after.heartbeat_interval != before.heartbeat_interval:
            log.info("%d nodes: heartbeat every %.1fs (max_heartbeats_per_second %g); unreachable after %.1fs, "
                     "lost after %.1fs", nodes, after.heartbeat_interval,
                     after.max_heartbeats_per_second, after.unreachable_after, after.lost_after)

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
        epoch = self.store.next_epoch()  # first: a StoreError refuses this registration and changes nothing
        session.epoch = epoch
        old = self.sessions.get(node_id)
        self.sessions[node_id] = session
        if old is not None and old is not session:
            old.close(f"superseded by a newer registration (epoch {epoch})")
        inventory = advertised(msg["hardware"])
        rec = self.nodes.get(node_id)
        if rec is None:
            rec = NodeRecord(node_id, inventory, NodeClock.seen(now), epoch, cordon=self.store.cordon_of(node_id))
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
        self._grown_to(len(self.nodes))
        log.info("node %s registered (epoch %d, agent %s, %d GPUs, %d shard(s) reported)",
                 node_id, epoch, rec.agent_version, len(inventory.gpus), len(msg["shards"]))
        refused: list[str] = []
        for line in self.reconciler.observe_register(node_id, msg["shards"], now, refused):
            log.log(logging.ERROR if line in refused else logging.INFO, "%s", line)
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
            self._learn_reported_size(node_id, msg)
        elif kind == "hardware":
            inventory = advertised(msg["hardware"])
            log.warning("node %s: hardware changed while connected: %d GPU(s) advertised%s", node_id,
                        len(inventory.gpus), f" ({inventory.gpu_reason})" if inventory.gpu_reason else "")
            rec.inventory, rec.shape = inventory, node_key(inventory)
            self.kick()
        return True

    def frame(self, node_id: str, epoch: int) -> None:
        """A ping or pong on the node's current stream: the connection is alive (its silence is not reset)."""
        rec = self.nodes.get(node_id)
        if rec is not None and rec.epoch == epoch:
            rec.clock.last_frame = self.clock()

    def _close_half_open(self, now: float, lc: Lifecycle) -> None:
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

    def _learn_reported_size(self, node_id: str, msg: dict[str, Any]) -> None:
        """An agent downloading a URL knows its length: a pass checks memory with it when it is news."""
        if self.sizes.learn_reported(node_id, msg, self.catalog):
            self.kick()

    def disconnected(self, node_id: str, epoch: int) -> None:
        rec = self.nodes.get(node_id)
        if rec is None or rec.epoch != epoch:
            return
        rec.connected = False
        self.sessions.pop(node_id, None)
        log.warning("node %s: stream closed (epoch %d); its engines keep serving", node_id, epoch)
        self.kick()

    # ---------------------------------------------------------------- actions
    def cordon(self, node_id: str, state: str | None) -> str | None:
        """Set a node's cordon (None, "cordoned", "draining"); returns the previous one.

        KeyError: a node that has not registered and has no stored cordon (one
        kept from before a restart can be lifted before its node is back).
        StoreError: the cordon could not be made durable; nothing changed.
        """
        rec = self.nodes.get(node_id)
        if rec is None and self.store.cordon_of(node_id) is None:
            raise KeyError(node_id)
        old = rec.cordon if rec is not None else self.store.cordon_of(node_id)
        self.store.set_cordon(node_id, state)
        if rec is not None:
            rec.cordon = state
        if old != state:
            log.info("node %s: %s by an operator", node_id, state or "uncordoned")
            self.kick()
        return old

    def leader_fields(self) -> dict[str, int]:
        """What every message to an agent carries with ``ha``: the term it was sent in."""
        return {"leader_epoch": self.leader_epoch} if self.leader_epoch else {}

    def take_over(self, epoch: int) -> None:
        """This process now leads (term ``epoch``): start from what the store says, with a failover grace.

        Intent is read again (the previous leader may have changed it), and
        the startup grace counts from now: agents are still moving over from
        the old leader, and none may be judged lost, nor anything placed,
        before they have had the grace to register here.
        """
        self.store.reload()
        self.reconciler.keys = grantsecret.from_store(self.store)
        for node_id, rec in self.nodes.items():
            rec.cordon = self.store.cordon_of(node_id)
        self.leader_epoch = epoch
        self.started_at = self.clock()
        self.evaluation = Evaluation()
        log.warning("leading as term %d: %d cordon(s), %d drain(s) from the store; failover grace %gs",
                    epoch, len(self.store.intent.cordons), len(self.store.intent.drains),
                    self.settings.lifecycle.startup_grace)
        self.kick()

    def drain(self, replica_id: str) -> None:
        """An operator drains a replica. KeyError, ValueError: see ``Reconciler.drain``; StoreError: nothing changed."""
        r = self.reconciler.book.replicas.get(replica_id)
        if r is None:
            raise KeyError(replica_id)
        if r.retired:
            raise ValueError(f"replica {replica_id} is already {r.state.value}")
        self.store.add_drain(replica_id)
        self.reconciler.drain(replica_id, self.clock())
        log.info("%s: drain requested", replica_id)
        self.kick()

    def _resume_drains(self, in_grace: bool) -> None:
        """Replica drains kept from before a restart: drain each again once its replica is back.

        One whose replica is not in the book after the startup grace has
        finished (or its node never came back) and is forgotten.
        """
        book, gone = self.reconciler.book, set()
        for rid in self.store.intent.drains:
            r = book.replicas.get(rid)
            if r is None:
                if not in_grace:
                    gone.add(rid)
            elif not r.retired:
                self.reconciler.drain(rid, self.clock())
                log.info("%s: draining again (drained by an operator before a restart)", rid)
                self._dirty = True
        if gone:
            try:
                self.store.forget_drains(gone)
            except Exception as e:  # retried on the next pass; nothing is lost by keeping them
                log.warning("cannot forget finished drains in %s: %s", self.store.backend.where, e)

    def router_watching(self, router: str) -> None:
        """A router certificate polled the endpoint watch: it counts towards the routers that watch."""
        self.ejections.watched(router, self.clock())

    def router_report(self, router: str, entries: list[dict[str, Any]], instance: str = "") -> None:
        """A validated ejection report from one worker (``instance``) of the router certificate ``router``."""
        self.ejections.observe(router, entries, self.clock(), instance)
        self.kick()

    def _judge_ejections(self, now: float) -> None:
        """Routers' reports -> verdicts; a replica judged sick is marked for replacement."""
        policy = self.settings.router_ejections
        self.ejections.expire(now, policy.report_ttl)
        verdicts: dict[str, Verdict] = {}
        book = self.reconciler.book
        for rid in list(self.ejections.reports):
            r = book.replicas.get(rid)
            if r is None or r.retired:
                self.ejections.forget(rid)
                continue
            # an adopted replica was Ready before this control plane started: when is not known here
            v = judge(self.ejections, rid, None if r.adopted else r.ready_since, now, policy)
            act = v.sick and r.state is ReplicaState.READY and r.surge_for is None and r.sick is None
            if act and not self.ejection_limiter.available(now):  # the shared bound: judged again next pass
                v, act = held(v, policy, len(self.ejection_limiter.made)), False
            verdicts[rid] = v
            if rid not in self.ejection_verdicts or self.ejection_verdicts[rid].reason != v.reason:
                log.log(logging.WARNING if v.sick else logging.INFO, "%s: %s", rid, v.reason)
            if act and self.reconciler.mark_sick(rid, v.reason):
                self.ejection_limiter.take(now)
                self.replaced_for_ejections += 1
                log.warning("%s: judged sick (%s); replacing it, make before break", rid, v.reason)
                self._dirty = True
        self.ejection_verdicts = verdicts

    def apply_settings(self, settings: ServerSettings, source: str | None) -> None:
        """Put a reloaded, already validated ``server.yaml`` in force."""
        old = self.settings
        self.loaded = Loaded(settings, source)
        self.limiter.retune(settings.lifecycle.replacements_per_minute, self.clock())
        self.ejection_limiter.retune(settings.router_ejections.replacements_per_minute, self.clock())
        for what, a, b in (("api.listen", (old.api_host, old.api_port), (settings.api_host, settings.api_port)),
                           ("tls", _files(old.tls), _files(settings.tls)),
                           ("insecure_no_tls", old.insecure_no_tls, settings.insecure_no_tls),
                           ("router", old.router, settings.router), ("state_dir", old.state_dir, settings.state_dir)):
            if a != b:
                log.warning("reload: %s changed; it takes effect at the next restart", what)
        if old.tls is None and not settings.admin_tokens:
            log.error("reload: no TLS and no api.admin_tokens: every admin request is refused (401) "
                      "until api.admin_tokens is configured")
        log.info("reload: catalog now %d model(s), %d profile(s), %d deployment(s)", len(settings.catalog.models),
                 len(settings.catalog.profiles), len(settings.catalog.deployments))
        self.kick()

    def tick(self) -> Plan:
        """One pass: lifecycle, then (when anything may have changed) reconcile, dispatch, endpoints.

        The lifecycle runs every time: silence is news only a clock can bring.
        The whole-fleet reconcile runs when something was observed (every
        observation kicks), when the lifecycle moved, while the last pass left
        work undone (unplaced slots, replicas not serving, strays), and at
        least every ``FULL_PASS_EVERY`` seconds regardless.  A settled fleet
        of thousands of nodes then costs a lifecycle pass per tick, not a
        reconcile of every replica.
        """
        if not self.authority():
            return Plan()  # a standby (or a leader past its lease) acts on nothing
        now = self.clock()
        lc = self.lifecycle()
        clocks = {n: rec.clock for n, rec in self.nodes.items()}
        self._excuse_stall(clocks, now)
        prev = self.evaluation
        ev = evaluate(clocks, now, self.started_at, lc, prev.last_damped)
        if ev.hold_reason and ev.hold_reason != prev.hold_reason and ev.held:
            log.warning("not declaring %s lost: %s", ", ".join(ev.held), ev.hold_reason)
        self.evaluation = ev
        if ev.transitions or (ev.in_grace, ev.damped) != (prev.in_grace, prev.damped):
            self._dirty = True
        self._close_half_open(now, lc)
        if self.ejections.reports or self.ejection_verdicts:
            self._judge_ejections(now)
        if self.store.intent.drains:
            self._resume_drains(ev.in_grace)
        for tr in ev.transitions:
            self.nodes[tr.node_id].last_reason = tr.reason
            level = logging.ERROR if tr.new is NodeState.LOST else logging.WARNING
            log.log(level, "node %s: %s -> %s (%s)", tr.node_id, tr.old.value, tr.new.value, tr.reason)
        if not (self._dirty or not self._settled or now - self._last_full >= FULL_PASS_EVERY):
            return Plan()
        self._dirty, self._last_full = False, now
        ctx = Context(restart=self.settings.restart, memory_headroom=self.settings.memory_headroom,
                      in_grace=ev.in_grace, damped=ev.damped, limiter=self.limiter,
                      weight_sizes=dict(self.sizes.bytes), sizing=self.sizes.holding(now), wall=time.time())
        views = self.node_views()
        plan = self.reconciler.reconcile(self.catalog, views, now, ctx)
        for line in plan.events:
            log.info("%s", line)
        self._log_unplaced(plan.unplaced)
        self.unplaced = plan.unplaced
        self.drain_blocked = plan.drain_blocked
        for action in plan.actions:
            session = self.sessions.get(action.node_id)
            if session is None or not session.send({**action.message(), **self.leader_fields()}):
                log.warning("%s for %s: node %s has no open stream; its next registration will settle it",
                            type(action).__name__.lower(), getattr(action, "shard_id", None) or
                            action.spec["shard_id"], action.node_id)  # type: ignore[union-attr]
        doubles = self.reconciler.book.double_claims()
        for node_id, gpu, ids in doubles:
            log.error("GPU %d on %s is held by more than one shard: %s", gpu, node_id, ", ".join(ids))
        self._publish_endpoints(views)
        self._settled = (not plan.unplaced and not plan.drain_blocked and not plan.actions
                        and self.reconciler.book.settled())
        return plan

    def _excuse_stall(self, clocks: dict[str, NodeClock], now: float) -> None:
        """Push every node's silence deadline back by the time this process's loop was stalled.

        Heartbeats that arrived while the loop was paused sit unread in the
        sockets; without this, the first pass after a pause would find every
        node silent for as long as the pause and declare the fleet unreachable.
        """
        # A loop always runs a little late; excusing each millisecond would walk
        # every node's clock on every pass.  Lateness adds up until it matters.
        self._stall_owed += self.looplag.take()
        if self._stall_owed < STALL_EXCUSED_FROM:
            return
        stall, self._stall_owed = self._stall_owed, 0.0
        excuse(clocks.values(), stall, now)
        self.stalled += stall
        if stall >= 1.0:
            log.warning("control plane stalled for %.1fs (its event loop did not run); "
                        "not counted against the nodes' heartbeats", stall)

    def _log_unplaced(self, unplaced: dict[tuple[str, int], str]) -> None:
        """One line per deployment and reason, when it changes, not one per slot.

        A fleet coming up has thousands of slots waiting for the same reason;
        a line each, on every pass whose reason text moved, is megabytes of
        log a minute and CPU the control plane needs for its agents.
        """
        grouped: dict[tuple[str, str], list[int]] = {}
        for (key, slot), why in unplaced.items():
            if not why.startswith("restarting in"):  # the failure was logged; the countdown is in ctl
                grouped.setdefault((key, why), []).append(slot)
        for (key, why), slots in grouped.items():
            if self._last_unplaced_logged.get((key, why)) != slots:
                shown = ", ".join(f"#{n}" for n in slots[:5]) + (f" and {len(slots) - 5} more" if len(slots) > 5 else "")
                log.warning("%s: %d replica(s) not placed, slot(s) %s: %s", key, len(slots), shown, why)
        self._last_unplaced_logged = grouped

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
        """Tick on every kick, and at least every ``interval`` seconds.

        Each catalog in force (at start, after every reload) first has its
        unsized URLs probed in the background (``WeightSizes.refresh``).
        """
        lag = asyncio.get_running_loop().create_task(self.looplag.run(), name="loop lag")
        try:
            while True:
                self._start_sizing_safely()
                period = interval or max(0.2, min(1.0, self.settings.lifecycle.heartbeat_interval / 2))
                try:
                    await compat.wait_for(self._kick.wait(), timeout=period)
                except TimeoutError:
                    pass
                self._kick.clear()
                self._start_sizing_safely()
                began = time.perf_counter()
                try:
                    self.tick()
                except Exception:
                    log.exception("reconcile pass failed; retrying on the next tick")
                # A pass over a large fleet holds the loop for a while; during a
                # registration storm the next kick is already waiting, so leave
                # the stream as much time again before the next pass.
                spent = time.perf_counter() - began
                if spent > 0.05:
                    await asyncio.sleep(min(5.0, spent * (1 - PASS_SHARE) / PASS_SHARE))
        finally:
            lag.cancel()
            self.sizes.cancel()

    def _start_sizing_safely(self) -> None:
        try:
            self.sizes.refresh(self.loaded, self.catalog)
        except Exception:
            log.exception("cannot start sizing the catalog's weights; placement goes on without")
