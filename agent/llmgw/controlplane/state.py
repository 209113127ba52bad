"""The control plane: the parts that hold its state, composed, and the loop that acts on them.

This is the glue between the stream (``agentservice``), the pure rules
(``lifecycle``, ``reconciler``) and the router's endpoint table.  Each
concern is a part of its own: the nodes and their streams
(``nodestreams``), the lifecycle's clocks (``lifecycletimers``), operators'
intent (``operatorintent``), routers' ejection reports (``routerreports``),
weights sizes (``sizing``), when a whole pass runs (``passgate``) and who
hears of the endpoints (``endpointfeed``).  ``ControlPlane`` wires them and
runs one pass (``tick``) in a fixed order; it does none of their work.

Nodes and replicas are rebuilt from registrations on purpose; only what no
agent can report back (operators' cordons and drains, the epoch reached) is
kept in the ``store`` (``controlplane/store.py``), written before it takes
effect.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from llmgw import compat
from llmgw.catalog import Catalog
from llmgw.controlplane import grantsecret
from llmgw.controlplane.autoscale_lend import Lending
from llmgw.controlplane.autoscale_sleep import SleepPlanner
from llmgw.controlplane.autoscale_zero import from_zero_keys, from_zero_names
from llmgw.controlplane.autoscaler import Autoscaler, totals_by_deployment
from llmgw.controlplane.ejections import EjectionBook, Verdict
from llmgw.controlplane.endpointfeed import EndpointFeed, Published
from llmgw.controlplane.enginesignals import SignalBook
from llmgw.controlplane.enginesignals_ask import Asked, Timing, timing, walk
from llmgw.controlplane.grants import GrantKeys
from llmgw.controlplane.lifecycle import Evaluation, ReplacementLimiter
from llmgw.controlplane.lifecycletimers import LifecycleTimers
from llmgw.controlplane.looplag import LoopLag
from llmgw.controlplane.noderecord import NodeRecord, Session, advertised
from llmgw.controlplane.nodestreams import NodeStreams
from llmgw.controlplane.operatorintent import OperatorIntent
from llmgw.controlplane.pairproof import PairProver
from llmgw.controlplane.passgate import PassGate
from llmgw.controlplane.reconciler import Context, NodeView, Plan, Reconciler, endpoints
from llmgw.controlplane.routekeys import RouteKeyBook
from llmgw.controlplane.routerload import RouterLoad
from llmgw.controlplane.routerreports import RouterReports
from llmgw.controlplane.sizing import WeightSizes
from llmgw.controlplane.store import ControlPlaneStore, MemoryBackend
from llmgw.controlplane.unplacedlog import UnplacedLog
from llmgw.settings import Lifecycle, ServerSettings, TLSFiles

# ``advertised``, ``NodeRecord`` and ``Session`` were defined here; their home is ``noderecord``.
__all__ = ["ControlPlane", "Loaded", "NodeRecord", "Session", "advertised"]

log = logging.getLogger("llmgw.controlplane")


@dataclass
class Loaded:
    """A catalog in force, with where it came from."""

    settings: ServerSettings
    source: str | None
    loaded_at: float = field(default_factory=time.time)


PASS_SHARE = 0.5  # at most this share of the event loop goes to back-to-back reconcile passes
# ... and this share while agents are being held or turned away at the door (dials waiting for, or
# dropped before, their TLS handshake in the last SHEDDING_HOLD seconds): each pass walks the whole
# fleet whatever arrived since the last, so fewer passes place the same replicas, and the loop's time
# goes to letting agents in.  The same during a startup grace: a pass then places nothing (it marks
# adopted replicas ready and publishes endpoints), and registrations are what ends the grace.
PASS_SHARE_SHEDDING = 0.2
SHEDDING_HOLD = 2.0


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
        self.started_wall = time.time()
        self.reconciler = Reconciler(keys=keys, cp_epoch=self.store.epoch)
        self.limiter = ReplacementLimiter(settings.lifecycle.replacements_per_minute)
        self.gate = PassGate()
        self.timers = LifecycleTimers(clock(), after_a_run=self.store.epoch > 0)
        self.streams = NodeStreams(clock, self.store, self.reconciler, self.kick,
                                   lambda n: self.timers.grown_to(n, self.settings.lifecycle),
                                   self._learn_reported_size)
        self.intent = OperatorIntent(self.store, self.reconciler, self.streams.nodes, clock, self.kick)
        self.router_reports = RouterReports(settings.router_ejections.replacements_per_minute)
        # standalone routers' requests in flight per replica (POST /v1/router/load): the autoscaler's signal
        self.router_load = RouterLoad()
        self.endpoint_feed = EndpointFeed()
        # Prefill replicas reach the routers once a prefill -> decode round trip proved them (``pairproof``).
        self.pair_prover = PairProver(lambda: self.kick(), ca=settings.tls.ca if settings.tls else None)
        self.route_keys = RouteKeyBook(self._rank0_replica)  # what each replica's engine caches, as route keys
        self.unplaced_log = UnplacedLog()
        self.sizes = WeightSizes(lambda: self.clock(), lambda: self.kick())  # placement waits on and reads these
        self.unplaced: dict[tuple[str, int], str] = {}
        self.autoscaler = Autoscaler()
        self.lending = Lending()  # sleeping deployments' GPUs lent to others (autoscale.sleep.lend)
        # the engines' queue depth and KV-cache use, as agents report them (autoscale on an engine signal)
        self.engine_signals = SignalBook(self._rank0_replica, self._deployment_of)
        self.signals_asked = Asked()  # what each node's stream was told to read (engine_signals_wanted)
        self._signal_nodes = 0  # nodes asked to read engine signals (the period stretches with them)
        self._walked: tuple[float, Catalog | None, dict[str, int]] = (float("-inf"), None, {})  # the last walk's
        # The in-process router's requests in flight per replica id (``RouterHook.outstanding``): the
        # autoscaler's signal with the standalone routers' reports (``router_load``).  None without an
        # in-process router: the reports alone then (with neither, autoscaled counts stay put).
        self.outstanding: Callable[[], Mapping[str, int]] | None = None
        self._silent_routers: list[str] = []  # routers whose load reports stopped lately (autoscaling holds)
        self.replica_counts: dict[str, int] = {}  # autoscaled deployments' counts, as the last pass placed them
        self.sleep_planner = SleepPlanner()  # scale to sleep: which replica to sleep or wake (autoscale_sleep.py)
        self._totals: dict[str, float] | None = None  # the last pass's requests in flight per deployment
        self._counts: dict[str, int] = {}  # the last pass's autoscaled counts, to log each change once
        self.drain_blocked: dict[str, str] = {}  # draining node(s) -> why the next move waits
        self.reload_errors: list[str] = []
        self.stopping = False  # SIGTERM: no new stream is admitted, none registering is kept
        self.shedding_until = float("-inf")  # passes take PASS_SHARE_SHEDDING of the loop until then
        # Agents' dials by what became of them (the kinds of ``lifecycletimers.ARRIVALS``), since start
        self.dials: Counter[str] = Counter()
        self.pass_pause = (0.0, 0.0)  # the last long pass: seconds it held the loop, seconds the loop got after it

    # ------------------------------------------------------------------ access
    @property
    def settings(self) -> ServerSettings:
        return self.loaded.settings

    @property
    def catalog(self) -> Catalog:
        return self.loaded.settings.catalog

    @property
    def nodes(self) -> dict[str, NodeRecord]:
        return self.streams.nodes

    @property
    def sessions(self) -> dict[str, Session]:
        return self.streams.sessions

    @property
    def started_at(self) -> float:
        return self.timers.started_at

    @property
    def evaluation(self) -> Evaluation:
        return self.timers.evaluation

    @property
    def looplag(self) -> LoopLag:
        return self.timers.looplag

    @looplag.setter
    def looplag(self, lag: LoopLag) -> None:
        self.timers.looplag = lag

    @property
    def stalled(self) -> float:
        return self.timers.stalled

    @property
    def ejections(self) -> EjectionBook:
        return self.router_reports.book

    @property
    def ejection_verdicts(self) -> dict[str, Verdict]:
        return self.router_reports.verdicts

    @property
    def replaced_for_ejections(self) -> int:
        return self.router_reports.replaced

    def on_endpoints(self, listener: Callable[[Published], None]) -> None:
        """Call ``listener`` with the rank-0 endpoint set whenever it changes (and now)."""
        self.endpoint_feed.subscribe(listener, self._endpoints(self.node_views()))

    def _endpoints(self, views: dict[str, NodeView]) -> Published:
        """The endpoint set to publish: every Ready replica's rank 0, less prefill replicas not proved yet;
        and the served names of the deployments that scale from zero."""
        return Published(self.pair_prover.publishable(self.reconciler.book, endpoints(self.reconciler.book, views),
                                                      self.clock(), self.clock),
                         from_zero_names(self.catalog))

    def node_views(self) -> dict[str, NodeView]:
        return self.streams.views()

    def kick(self) -> None:
        """Something was observed: the next tick reconciles the whole fleet."""
        self.gate.kick()

    def lifecycle(self) -> Lifecycle:
        """The lifecycle timings in force (``LifecycleTimers.lifecycle``: stretched for a large fleet)."""
        return self.timers.lifecycle(self.settings.lifecycle)

    def is_current(self, node_id: str, epoch: int) -> bool:
        return self.streams.is_current(node_id, epoch)

    # ---------------------------------------------------------------- stream
    def register(self, msg: dict[str, Any], session: Session, peer: str | None = None,
                 certificate: dict[str, Any] | None = None) -> int:
        """A validated, identity-checked ``register``: a new epoch (``NodeStreams.register``)."""
        epoch = self.streams.register(msg, session, peer, certificate)
        self.arriving("registered")
        return epoch

    def arriving(self, kind: str) -> None:
        """A sign of an agent arriving (``lifecycletimers.ARRIVALS``): it holds the startup grace while it lasts."""
        now = self.clock()
        self.dials[kind] += 1
        if kind in ("shed", "waiting"):
            self.shedding_until = now + SHEDDING_HOLD
        self.timers.note_arrival(now, kind, self.settings.lifecycle)

    def pass_share(self) -> float:
        """The share of the loop back-to-back reconcile passes may take now (``PASS_SHARE``)."""
        if self.timers.evaluation.in_grace or self.clock() < self.shedding_until:
            return PASS_SHARE_SHEDDING
        return PASS_SHARE

    def message(self, node_id: str, epoch: int, msg: dict[str, Any]) -> bool:
        """A validated message after ``register``; False (and no effect) if its stream is superseded."""
        if msg["type"] == "kv_routes":  # no news of the node's health: only of its engines' caches
            if not self.streams.is_current(node_id, epoch):
                return False
            if log.isEnabledFor(logging.DEBUG):  # opaque keys only: nothing a prompt could be read from
                log.debug("kv_routes from %s: %s", node_id, json.dumps(msg, separators=(",", ":")))
            self.route_keys.apply(node_id, msg, self.clock())
            return True
        if msg["type"] == "engine_signals":  # news of the engines' load only, not of the node's health
            if not self.streams.is_current(node_id, epoch):
                return False
            self.engine_signals.apply(node_id, epoch, msg, self.clock())
            return True
        return self.streams.message(node_id, epoch, msg)

    def _rank0_replica(self, node_id: str, shard_id: str) -> str | None:
        """The replica whose rank 0 is ``shard_id``, booked on ``node_id``; None for anything else (a stray)."""
        book = self.reconciler.book
        s = book.find(node_id, shard_id)
        if s is None or s.rank != 0 or book.strays.get((node_id, shard_id)) is s:
            return None
        return s.replica_id

    def _deployment_of(self, replica_id: str) -> str | None:
        r = self.reconciler.book.replicas.get(replica_id)
        return None if r is None else r.key

    def frame(self, node_id: str, epoch: int) -> None:
        """A ping or pong on the node's current stream: the connection is alive (its silence is not reset)."""
        self.streams.frame(node_id, epoch)

    def disconnected(self, node_id: str, epoch: int) -> None:
        self.streams.disconnected(node_id, epoch)

    def _learn_reported_size(self, node_id: str, msg: dict[str, Any]) -> None:
        """An agent downloading a URL knows its length: a pass checks memory with it when it is news."""
        if self.sizes.learn_reported(node_id, msg, self.catalog):
            self.kick()

    # ---------------------------------------------------------------- actions
    def cordon(self, node_id: str, state: str | None) -> str | None:
        """Set a node's cordon; returns the previous one (``OperatorIntent.cordon``)."""
        return self.intent.cordon(node_id, state)

    def drain(self, replica_id: str) -> None:
        """An operator drains a replica (``OperatorIntent.drain``)."""
        self.intent.drain(replica_id)

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
        self.intent.refresh_cordons()
        self.leader_epoch = epoch
        self.timers.restart(self.clock(), after_a_run=self.store.epoch > 0)
        log.warning("leading as term %d: %d cordon(s), %d drain(s) from the store; failover grace %gs",
                    epoch, len(self.store.intent.cordons), len(self.store.intent.drains),
                    self.settings.lifecycle.startup_grace)
        self.kick()

    def router_watching(self, router: str) -> None:
        """A router certificate polled the endpoint watch: it counts towards the routers that watch."""
        self.router_reports.watching(router, self.clock())

    def router_report(self, router: str, entries: list[dict[str, Any]], instance: str = "") -> None:
        """A validated ejection report from one worker (``instance``) of the router certificate ``router``."""
        self.router_reports.report(router, entries, self.clock(), instance)
        self.kick()

    def apply_settings(self, settings: ServerSettings, source: str | None) -> None:
        """Put a reloaded, already validated ``server.yaml`` in force."""
        old = self.settings
        self.loaded = Loaded(settings, source)
        self.limiter.retune(settings.lifecycle.replacements_per_minute, self.clock())
        self.router_reports.limiter.retune(settings.router_ejections.replacements_per_minute, self.clock())
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
        The whole-fleet reconcile runs when ``PassGate`` says it is due: when
        something was observed (every observation kicks), when the lifecycle
        moved, while the last pass left work undone (unplaced slots, replicas
        not serving, strays), and at least every ``FULL_PASS_EVERY`` seconds.
        """
        if not self.authority():
            return Plan()  # a standby (or a leader past its lease) acts on nothing
        now = self.clock()
        lc = self.lifecycle()
        clocks = {n: rec.clock for n, rec in self.nodes.items()}
        if self.timers.evaluate(clocks, now, lc):
            self.gate.mark()
        ev = self.timers.evaluation
        self.streams.close_half_open(now, lc)
        if self.router_reports.pending and self.router_reports.judge(
                self.reconciler.book, self.reconciler.mark_sick, self.settings.router_ejections, now):
            self.gate.mark()
        if self.store.intent.drains and self.intent.resume_drains(ev.in_grace):
            self.gate.mark()
        self.streams.note_transitions(ev.transitions)
        counts = self._lend(now, ev.in_grace, self._autoscale(now, ev.in_grace))
        if counts != self.replica_counts:
            self.replica_counts = counts
            self.gate.mark()
        self._sleep_and_wake(now, ev.in_grace, counts)
        if not self.gate.open(now):
            return Plan()
        ctx = Context(restart=self.settings.restart, memory_headroom=self.settings.memory_headroom,
                      in_grace=ev.in_grace, damped=ev.damped, limiter=self.limiter,
                      weight_sizes=dict(self.sizes.bytes), sizing=self.sizes.holding(now), wall=time.time(),
                      replica_counts=self.replica_counts)
        views = self.node_views()
        plan = self.reconciler.reconcile(self.catalog, views, now, ctx)
        for line in plan.events:
            log.info("%s", line)
        self.unplaced_log.log(plan.unplaced)
        self.unplaced = plan.unplaced
        self.drain_blocked = plan.drain_blocked
        self.streams.dispatch(plan.actions, self.leader_fields())
        doubles = self.reconciler.book.double_claims()
        for node_id, gpu, ids in doubles:
            log.error("GPU %d on %s is held by more than one shard: %s", gpu, node_id, ", ".join(ids))
        self.endpoint_feed.publish(self._endpoints(views))
        for rid in [r for r in self.route_keys.replicas if r not in self.reconciler.book.replicas]:
            self.route_keys.forget(rid)
        self._ask_for_engine_signals(now)
        self.gate.settled = (not plan.unplaced and not plan.drain_blocked and not plan.actions
                             and self.reconciler.book.settled())
        return plan

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
                    await compat.wait_for(self.gate.woken.wait(), timeout=period)
                except TimeoutError:
                    pass
                self.gate.woken.clear()
                self._start_sizing_safely()
                began = time.perf_counter()
                try:
                    self.tick()
                except Exception:
                    log.exception("reconcile pass failed; retrying on the next tick")
                # A pass over a large fleet holds the loop for a while; during a
                # registration storm the next kick is already waiting, so leave
                # the streams as much time again before the next pass (four times
                # as much while agents are turned away at the door: pass_share).
                spent = time.perf_counter() - began
                self.looplag.held(spent)  # paced below: admission must not read it as overload
                if spent > 0.05:
                    share = self.pass_share()
                    self.pass_pause = (spent, min(5.0, spent * (1 - share) / share))
                    await asyncio.sleep(self.pass_pause[1])
        finally:
            lag.cancel()
            self.sizes.cancel()
            self.pair_prover.cancel()

    def _autoscale(self, now: float, in_grace: bool) -> dict[str, int]:
        """Autoscaled deployments' counts, the routers' load fed to their scalers first: this control
        plane's own router's and the standalone routers' reports (``routerload``). While a router that
        reported lately is silent nothing is sampled: its requests may still be in flight."""
        if not any(d.autoscale is not None for d in self.catalog.deployments):
            return {}
        totals = None
        reported = self.router_load.totals(now)
        silent = self.router_load.silent(now)
        if silent and not in_grace:
            if silent != self._silent_routers:
                log.warning("autoscale: router(s) %s stopped reporting their load; counts hold until they report "
                            "or are forgotten", ", ".join(silent))
        elif (self.outstanding is not None or self.router_load.workers(now)) and not in_grace:
            merged = dict(self.outstanding()) if self.outstanding is not None else {}
            for rid, n in reported.items():
                merged[rid] = merged.get(rid, 0) + n
            totals = totals_by_deployment(merged, self.reconciler.book)
        self._silent_routers = silent
        self._totals = totals
        engine = None
        if not in_grace:
            self.engine_signals.sweep(now, self.signal_timing(), self.streams.is_open,
                                      self.reconciler.book.replicas.__contains__)
            engine = self.engine_signals.samples()
        counts = self.autoscaler.counts(self.catalog, self.reconciler.book, now, totals, in_grace, engine)
        for key, n in counts.items():
            was = self._counts.get(key)
            if was is not None and n != was:  # a change of count, with what the rule saw: the operator's why
                scaler, grant = self.autoscaler.scalers.get(key), self.autoscaler.grant(key)
                log.info("autoscale %s: %d -> %d replica(s)%s%s", key, was, n,
                         f": {scaler.decision.explain(scaler.policy)}" if scaler is not None else "",
                         f"; {grant.explain()}" if grant is not None else "")
        self._counts = counts
        return counts

    def _lend(self, now: float, in_grace: bool, counts: dict[str, int]) -> dict[str, int]:
        """``counts`` with the deployments that lent their GPUs at zero (``autoscale_lend``), a new loan made
        where the last pass left a slot unplaced that a sleeping lender's GPUs would place."""
        if not self.lending.loans and not any(d.autoscale is not None and d.autoscale.lends
                                              for d in self.catalog.deployments):
            return counts
        self.lending.forget(self.catalog)
        if not in_grace and self.unplaced:  # (the node views are built only when a slot waits)
            loan = self.lending.lend(self.catalog, self.reconciler.book, self.node_views(), self.unplaced, now,
                                     self.settings.memory_headroom, self.sizes.bytes)
            if loan is not None:
                log.info("%s: every replica asleep; lending its GPUs to %s, which cannot be placed without them "
                         "(back from zero replicas on its next request)", loan.lender, loan.borrower)
        return self.lending.counts(counts)

    def signal_timing(self) -> Timing:
        """The engine signals' period for the nodes asked now (``enginesignals_ask.timing``)."""
        lc = self.settings.lifecycle
        return timing(lc.engine_signal_period, lc.max_engine_signals_per_second, self._signal_nodes)

    def _ask_for_engine_signals(self, now: float) -> None:
        """Tell each connected node which engines to read for autoscaling, when that changed (``Asked``), and
        the signals' book which replicas are Ready. The walk over the book takes about 100 ms at 80,000
        replicas, so it runs at most once a period in the whole-fleet passes, sooner only for a new stream
        or a reloaded catalog: a replica placed or Ready since waits for it at most a period."""
        epochs = {n: s.epoch for n, s in self.sessions.items()}
        fresh = (self.catalog is self._walked[1] and epochs == self._walked[2]
                 and now - self._walked[0] < self.signal_timing().period)
        if fresh:
            return
        self._walked = (now, self.catalog, epochs)
        want, members = walk(self.catalog, self.reconciler.book)
        self.engine_signals.set_members(members)
        if not want and not self.signals_asked.told:
            return
        self._signal_nodes = len(want)
        t = self.signal_timing()
        for node_id, msg in self.signals_asked.messages(want, epochs, t):
            self.sessions[node_id].send({**msg, **self.leader_fields()})

    def _sleep_and_wake(self, now: float, in_grace: bool, counts: dict[str, int]) -> None:
        """Scale to sleep: feed the planner the router's load, send the agents what it decides."""
        sleepy = [d.key for d in self.catalog.deployments if d.autoscale is not None and d.autoscale.sleep is not None]
        if not sleepy or in_grace or self._totals is None:
            return  # nothing measured (in grace, no router): nothing is judged idle
        for key in sleepy:
            self.sleep_planner.observe(key, now, self._totals.get(key, 0.0))
        actions = self.sleep_planner.decide(self.catalog, self.reconciler.book, counts, now)
        for a in actions:
            log.info("%s: asking %s to %s its engine", a.replica_id, a.node_id, type(a).__name__.lower())
        self.streams.dispatch(actions, self.leader_fields())  # type: ignore[arg-type]

    def wake_model(self, model: str, held: int | None = None, router: str = "") -> bool:
        """A router holds requests for ``model`` (a served name): wake its sleeping replicas now, and
        count ``held`` (sent by a router with no endpoint of it left) as the demand of the deployments
        serving it that scale from zero. False when no such deployment serves it."""
        keys = self.sleep_planner.sleeping_keys(self.catalog, model)
        zero = from_zero_keys(self.catalog, model)
        if not (keys or zero) or not self.authority():
            return False
        now = self.clock()
        if keys:
            self.sleep_planner.wake_requested(keys, now)
        for key in keys:
            loan = self.lending.end(key)
            if loan is not None:
                log.info("%s: asked for again; its GPUs' loan to %s ends and it is placed again", key, loan.borrower)
        for key in zero:
            self.autoscaler.note_held(key, router, 1 if held is None else held, now)
        self.kick()
        return True

    def _start_sizing_safely(self) -> None:
        try:
            self.sizes.refresh(self.loaded, self.catalog)
        except Exception:
            log.exception("cannot start sizing the catalog's weights; placement goes on without")
