"""The reconciler: from the catalog and what the fleet reports, what to do.

Pure and level-triggered.  Agent messages are *observations*
(``observe_register``, ``observe_status``, ``observe_progress``) that only
update the book; ``reconcile`` then looks at the whole picture and returns
the ``start``/``stop``/``drain`` messages to send.  Nothing here touches a
socket or a clock, so every rule is unit-tested with explicit times.

The fleet is authoritative about what runs:

- a shard an agent reports that we do not know is *adopted* only with a
  grant this control plane's secret verifies, issued for that very node,
  replica, rank, model and profile (``grants``); a claim without one is
  never routed, never competes for a slot, and is told to stop.  Its engine
  key is recomputed from the grant, never taken from the report;
- an adopted shard is kept when its model and profile are in the catalog
  exactly as it runs them, and stopped when they are not: nothing will route
  to it and it holds GPUs;
- a shard we believe runs on a node that its registration does not list is
  let go (a registration follows a fresh connection, so anything dispatched
  over an earlier one and not reported is not running); an empty list is
  news, not nothing;
- only what is not recognised is disowned: a reconnecting agent's serving
  shards are taken back as they are, never stopped;
- a GPU is held from the moment a ``start`` is dispatched until the agent
  says the shard ended, so placement can never hand it out twice.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from llmgw.catalog import Catalog, Deployment, weights_bytes
from llmgw.controlplane.capacity import FleetCapacity
from llmgw.controlplane.grants import Claim, GrantKeys, Verdict, engine_key, issue, new_nonce, verify
from llmgw.controlplane.lifecycle import NodeState, ReplacementLimiter
from llmgw.controlplane.replicas import (
    DRAINING,
    ENDED_STATES,
    FAILED,
    FETCHING,
    GONE,
    PENDING,
    READY,
    RUNNING_STATES,
    STARTING,
    STOPPED,
    WAITING,
    Replica,
    ReplicaBook,
    ReplicaState,
    Shard,
    model_to_dict,
    new_replica_id,
    profile_to_dict,
    shard_id,
    slot_of,
    spec_matcher,
)
from llmgw.hardware.types import HardwareInventory
from llmgw.placement import NodeCapacity, PlacementRequest, PlacementResult
from llmgw.settings import RestartPolicy

# An operator's drain lets in-flight requests finish; after this long the
# engine is stopped regardless, so a stuck drain cannot hold GPUs forever.
DRAIN_TIMEOUT = 300.0


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


@dataclass
class Plan:
    actions: list[Action] = field(default_factory=list)
    events: list[str] = field(default_factory=list)  # log lines: what was decided and why
    unplaced: dict[tuple[str, int], str] = field(default_factory=dict)  # (model/profile, slot) -> why not
    drain_blocked: dict[str, str] = field(default_factory=dict)  # draining node -> why its next move waits


def backoff(policy: RestartPolicy, failures: int) -> float:
    """Seconds before the next attempt after ``failures`` consecutive failures."""
    if failures <= 0:
        return 0.0
    return min(policy.backoff_max, policy.backoff_initial * (2 ** min(failures - 1, 30)))


def fleet_capacity(book: ReplicaBook, nodes: Mapping[str, NodeView]) -> FleetCapacity:
    """Every known node with the GPUs no shard holds."""
    return FleetCapacity.of({n: book.claimed(n) for n in nodes}, nodes)


def capacities(book: ReplicaBook, nodes: Mapping[str, NodeView]) -> list[NodeCapacity]:
    """Every known node with the GPUs no shard holds, in node-id order."""
    return fleet_capacity(book, nodes).everyone()


def placement_request(catalog: Catalog, dep: Deployment, headroom: float,
                      weight_sizes: Mapping[str, int] | None = None) -> PlacementRequest:
    """What one replica of ``dep`` needs; its weights are the declared size,
    else the size learned for the model's source, else unknown."""
    m = catalog.models[dep.model]
    return PlacementRequest(model=m, profile=catalog.profiles[dep.profile],
                            weights_bytes=weights_bytes(m, weight_sizes), memory_headroom=headroom)


def _keeper_rank(r: Replica) -> tuple:
    # Which of two replicas competing for one slot to keep: one this control
    # plane placed beats one it adopted (a report, even a granted one, never
    # displaces a placement); then serving beats starting beats failed; then
    # the longer-known one.
    order = {ReplicaState.READY: 0, ReplicaState.STARTING: 1, ReplicaState.FAILED: 2}
    return (r.adopted, order.get(r.state, 3), r.created_at, r.replica_id)


def claim_of(node_id: str, spec: dict[str, Any]) -> Claim:
    """What a reported spec claims, for ``grants.verify``."""
    return Claim(node_id=node_id, replica_id=spec["replica_id"], rank=spec["rank"], nnodes=spec["nnodes"],
                 model=spec["model"]["name"], profile=spec["profile"]["name"])


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
        """A node registered and listed every shard it runs (possibly none).

        Claims refused for want of a valid grant are also appended to
        ``refused`` (the caller logs them as errors).
        """
        book = self.book
        events: list[str] = []
        reported = {r["spec"]["shard_id"]: r for r in reports}
        for s in book.shards_on(node_id):
            if s.on_node and s.shard_id not in reported:
                s.state, s.state_since, s.progress = GONE, now, None
                s.reason = f"not reported by {node_id} when it registered: not running there"
                events.append(f"{s.shard_id} on {node_id}: let go ({s.reason})")
        for sid, rep in reported.items():
            spec, state = rep["spec"], rep["state"]
            known = book.find(node_id, sid)
            if known is not None:
                self._apply_report(known, rep, now)
                continue
            if state in ENDED_STATES:
                continue  # nothing runs, nothing is held
            verdict = self._check_grant(node_id, spec)
            shard = self._shard_from_report(node_id, rep, now)
            if not verdict.ok:
                shard.reason = f"refused: {verdict.reason}"
                book.add_stray(shard)
                line = (f"{sid} on {node_id}: refused, not adopted ({verdict.reason}): never routed; will stop it")
                events.append(line)
                if refused is not None:
                    refused.append(line)
                continue
            shard.spec = self._granted_spec(spec, verdict)
            r = book.replicas.get(spec["replica_id"])
            if r is None:
                r = self._adopt_candidate(spec, now)
                events.append(f"{spec['replica_id']}: rebuilt from {node_id}'s report "
                              f"({spec['model']['name']}/{spec['profile']['name']}, rank {spec['rank']} of {spec['nnodes']})")
            slot_free = (spec["rank"] in r.shards and r.shards[spec["rank"]].node_id is None
                         and spec["nnodes"] == r.nnodes
                         and (spec["model"]["name"], spec["profile"]["name"]) == (r.model, r.profile))
            if slot_free:
                book.set_shard(r, spec["rank"], shard)
                events.append(f"{sid} on {node_id}: adopted ({state})")
            else:
                book.add_stray(shard)
                events.append(f"{sid} on {node_id}: not recognised (replica {spec['replica_id']} has rank "
                              f"{spec['rank']} elsewhere or differs): will stop it")
        return events

    def observe_status(self, node_id: str, msg: dict[str, Any], now: float) -> list[str]:
        """A shard changed state on ``node_id`` (only shards of that node count)."""
        sid, state = msg["shard_id"], msg["state"]
        s = self.book.find(node_id, sid)
        if s is None:
            if state not in RUNNING_STATES:
                return []
            stray = Shard(shard_id=sid, replica_id=msg.get("replica_id") or sid.split("/")[0], rank=0,
                          node_id=node_id, gpu_indices=(), spec={}, state=state, state_since=now,
                          reason="reported by its agent but never started or adopted here")
            self.book.add_stray(stray)
            return [f"{sid} on {node_id}: unknown shard reported {state}: will stop it"]
        if state != s.state:
            s.state, s.state_since, s.progress = state, now, None
        for key in ("reason", "output_tail"):
            if key in msg:
                setattr(s, key, msg[key])
        if state == READY:
            s.reason, s.output_tail = None, None
        for key in ("process", "port", "master_port", "address"):
            if msg.get(key) is not None:
                setattr(s, key, msg[key])
        if msg.get("port") is not None:  # each report of an endpoint says how it serves (absent: http)
            s.scheme = msg.get("scheme", "http")
        if msg.get("engine_version") is not None:
            s.engine_version = msg["engine_version"]
        return [f"{sid} on {node_id}: {state}" + (f" ({msg['reason']})" if msg.get("reason") else "")]

    def observe_progress(self, node_id: str, msg: dict[str, Any], now: float) -> None:
        """Download progress: shown under the shards waiting on it, never a transition."""
        if msg.get("shard_ids"):
            targets = [self.book.find(node_id, sid) for sid in msg["shard_ids"]]
        else:
            targets = [s for s in self.book.shards_on(node_id)
                       if s.state in (PENDING, FETCHING, STARTING)
                       and s.spec.get("model", {}).get("source") == msg["source"]]
        info = {k: msg.get(k) for k in ("source", "file", "bytes_done", "bytes_total", "rate_bps", "note")}
        info["at"] = now
        for s in targets:
            # Only a shard still on its way up: a report that crossed a real
            # transition must not pin a stale line under a serving shard.
            if s is not None and not s.released and s.state in (PENDING, FETCHING, STARTING):
                s.progress = info

    def drain(self, replica_id: str, now: float) -> Replica:
        """An operator drains a replica: it leaves the router, finishes, stops, and is replaced."""
        r = self.book.replicas.get(replica_id)
        if r is None:
            raise KeyError(replica_id)
        if r.retired:
            raise ValueError(f"replica {replica_id} is already {r.state.value}")
        self._retire(r, "drained by an operator", now, draining=True)
        return r

    def mark_sick(self, replica_id: str, reason: str) -> bool:
        """A Ready replica judged sick from outside its shards' states: replace it, make before break.

        True when this is news.  The move itself is ``_drain_nodes``'s, as for a
        replica on a draining node: a twin first, the old one drained once the
        twin is Ready.
        """
        r = self.book.replicas.get(replica_id)
        if r is None or r.retired or r.failed_at is not None or r.sick is not None:
            return False
        r.sick = reason
        return True

    def _check_grant(self, node_id: str, spec: dict[str, Any]) -> Verdict:
        """Whether ``spec``'s grant is this control plane's, for exactly this node and shard."""
        if spec["shard_id"] != shard_id(spec["replica_id"], spec["rank"]):
            return Verdict(False, f"shard id {spec['shard_id']!r} is not rank {spec['rank']} of "
                                  f"{spec['replica_id']!r}")
        return verify(self.keys, spec.get("grant"), claim_of(node_id, spec))

    @staticmethod
    def _granted_spec(spec: dict[str, Any], verdict: Verdict) -> dict[str, Any]:
        """The reported spec with the engine key recomputed from its (verified) grant."""
        assert verdict.secret is not None
        return {**spec, "api_key": engine_key(verdict.secret, spec["replica_id"], spec["grant"]["nonce"])}

    def _shard_from_report(self, node_id: str, rep: dict[str, Any], now: float) -> Shard:
        spec = rep["spec"]
        s = Shard(shard_id=spec["shard_id"], replica_id=spec["replica_id"], rank=spec["rank"], node_id=node_id,
                  gpu_indices=tuple(spec["gpu_indices"]), spec=spec, adopted=True, state_since=now)
        self._apply_report(s, rep, now)
        return s

    @staticmethod
    def _apply_report(s: Shard, rep: dict[str, Any], now: float) -> None:
        if rep["state"] != s.state:
            s.state, s.state_since, s.progress = rep["state"], now, None
        if s.spec.get("grant") is not None:
            # A shard we placed or adopted: its grant and engine key are ours, not the report's.
            s.spec = {**rep["spec"], "grant": s.spec["grant"], "api_key": s.spec.get("api_key")}
        else:
            s.spec = rep["spec"]
        s.gpu_indices = tuple(rep["spec"]["gpu_indices"])
        if s.dispatched_at is None:
            s.dispatched_at = now
        for key in ("process", "port", "address"):
            if rep.get(key) is not None:
                setattr(s, key, rep[key])
        if rep.get("port") is not None:
            s.scheme = rep.get("scheme", "http")
        if rep.get("adopted"):
            s.adopted = True

    def _adopt_candidate(self, spec: dict[str, Any], now: float) -> Replica:
        rid = spec["replica_id"]
        model, profile = spec["model"]["name"], spec["profile"]["name"]
        r = Replica(replica_id=rid, model=model, profile=profile, nnodes=spec["nnodes"],
                    slot=slot_of(rid, model, profile), shards={}, created_at=now, adopted=True)
        for rank in range(spec["nnodes"]):
            r.shards[rank] = Shard(shard_id=shard_id(rid, rank), replica_id=rid, rank=rank, node_id=None,
                                   gpu_indices=(), spec={}, state=WAITING, state_since=now)
        self.book.add(r)
        return r

    # --------------------------------------------------------------- decisions

    def reconcile(self, catalog: Catalog, nodes: Mapping[str, NodeView], now: float, ctx: Context) -> Plan:
        plan = Plan()
        self._forget_lost_nodes(nodes, now, plan)
        self._resolve_double_claims(now, plan)
        self._retire_uncatalogued(catalog, now, plan)
        self._retire_on_lost_nodes(nodes, now, plan)
        self._retire_on_sick_gpus(nodes, now, plan)
        for dep in catalog.deployments:
            self._assign_slots(dep, now, plan)
        for r in list(self.book.live()):
            self._check_failures(r, catalog, now, ctx, plan)
        for r in list(self.book.live()):
            if r.failed_at is not None:
                self._stop_shards(r, nodes, plan, r.failure or "replica failed")
                if now >= self.book.slot(r.key, r.slot if r.slot is not None else -1).next_attempt_at:
                    self._retire(r, f"replaced after failure: {r.failure}", now)
            else:
                self._progress(r, catalog, nodes, now, plan)
        self._clean_retired(nodes, now, plan)
        self._clean_strays(nodes, plan)
        fleet: list[FleetCapacity] = []  # built on first need: most passes place nothing
        for dep in catalog.deployments:
            self._place_missing(catalog, dep, nodes, now, ctx, plan, fleet)
        self._drain_nodes(catalog, nodes, now, ctx, plan, fleet)
        return plan

    def _forget_lost_nodes(self, nodes: Mapping[str, NodeView], now: float, plan: Plan) -> None:
        # A lost node is unschedulable until it registers again, and that
        # registration reports what really runs there; until then nothing it
        # held needs guarding.
        for s in self.book.all_shards():
            n = nodes.get(s.node_id) if s.node_id else None
            if n is not None and n.state is NodeState.LOST and not s.released:
                s.state, s.state_since, s.progress = GONE, now, None
                s.reason = f"node {s.node_id} lost"

    def _resolve_double_claims(self, now: float, plan: Plan) -> None:
        for node_id, gpu, ids in self.book.double_claims():
            owners = {}
            for s in self.book.shards_on(node_id):
                if s.shard_id in ids and not s.released:
                    r = self.book.replicas.get(s.replica_id)
                    if r is not None and not r.retired and r.shards.get(s.rank) is s:
                        owners[r.replica_id] = r
            if len(owners) < 2:
                continue  # at most one live replica: the others are being stopped already
            ranked = sorted(owners.values(), key=_keeper_rank)
            for loser in ranked[1:]:
                self._retire(loser, f"GPU {gpu} on {node_id} is also held by {ranked[0].replica_id}", now)
                plan.events.append(f"{loser.replica_id}: retired, shares GPU {gpu} on {node_id} with {ranked[0].replica_id}")

    def _retire_uncatalogued(self, catalog: Catalog, now: float, plan: Plan) -> None:
        declared = {(d.model, d.profile) for d in catalog.deployments}
        outdated: dict[str, list[Replica]] = {}
        matchers: dict[tuple[str, str], Callable[[dict[str, Any]], bool]] = {}
        for r in self.book.live():
            if (r.model, r.profile) not in declared or r.model not in catalog.models or r.profile not in catalog.profiles:
                self._retire(r, f"{r.model}/{r.profile} is not in the catalog", now)
                plan.events.append(f"{r.replica_id}: stopping, {r.model}/{r.profile} is not in the catalog")
                continue
            matches = matchers.get((r.model, r.profile))
            if matches is None:
                matches = matchers[(r.model, r.profile)] = spec_matcher(catalog.models[r.model],
                                                                        catalog.profiles[r.profile])
            if any(s.spec and not matches(s.spec) for s in r.shards.values()):
                outdated.setdefault(r.key, []).append(r)
        # A changed definition is rolled out one replica at a time: the next
        # outdated replica is stopped only once every other replica of the
        # pair is serving, so a profile tweak never takes a model down whole.
        for key, olds in outdated.items():
            for r in olds:
                if r.state is not ReplicaState.READY:  # not serving: nothing to protect
                    self._retire(r, "its model/profile definition differs from the catalog's", now)
                    plan.events.append(f"{r.replica_id}: replacing, its spec differs from the catalog's {key}")
            serving = [r for r in olds if not r.retired]
            others = [r for r in self.book.replicas.values() if r.key == key and r not in serving]
            if not serving or any(r.retired or r.state is not ReplicaState.READY for r in others):
                continue
            victim = min(serving, key=lambda r: (r.slot if r.slot is not None else 1 << 30, r.replica_id))
            self._retire(victim, "its model/profile definition differs from the catalog's", now)
            plan.events.append(f"{victim.replica_id}: replacing, its spec differs from the catalog's {key}")

    def _retire_on_lost_nodes(self, nodes: Mapping[str, NodeView], now: float, plan: Plan) -> None:
        for r in self.book.live():
            lost = sorted(n for n in r.nodes() if n in nodes and nodes[n].state is NodeState.LOST)
            if lost:
                self._replace_lost(r, f"node {', '.join(lost)} lost", now, plan)

    def _retire_on_sick_gpus(self, nodes: Mapping[str, NodeView], now: float, plan: Plan) -> None:
        """A replica with a shard on a GPU its agent withholds as sick is replaced: the engine
        there cannot be trusted to serve, and the GPU will not be given out again."""
        for r in list(self.book.live()):
            for s in r.shards.values():
                node = nodes.get(s.node_id) if s.node_id else None
                if node is None or s.released or not node.inventory.sick_gpus:
                    continue
                sick = {g.index: g.reason for g in node.inventory.sick_gpus}
                bad = [g for g in s.gpu_indices if g in sick]
                if bad:
                    self._replace_lost(r, "; ".join(f"GPU {g} on {s.node_id} withheld as sick: {sick[g]}"
                                                    for g in bad), now, plan)
                    break

    def _replace_lost(self, r: Replica, reason: str, now: float, plan: Plan) -> None:
        """Retire ``r`` for a loss that is not its own fault and replace it at once (no backoff),
        keeping why as its slot's last failure."""
        self._retire(r, reason, now)
        if r.slot is not None:
            hist = self.book.slot(r.key, r.slot)
            hist.needs_replacement_token = True
            hist.last_failure = {"replica_id": r.replica_id, "reason": reason, "output_tail": None, "at": now}
        plan.events.append(f"{r.replica_id}: {reason}; replacing it")

    def _assign_slots(self, dep: Deployment, now: float, plan: Plan) -> None:
        # A replica being started to take another's place (a node drain) has no slot
        # of its own until it is Ready and takes over the old one's.
        mine = sorted((r for r in self.book.live() if (r.model, r.profile) == (dep.model, dep.profile)
                       and r.surge_for is None), key=_keeper_rank)
        taken: dict[int, Replica] = {}
        extras: list[Replica] = []
        for r in mine:
            if r.slot is not None and 0 <= r.slot < dep.replicas and r.slot not in taken:
                taken[r.slot] = r
            else:
                extras.append(r)
        for r in extras:
            free = next((i for i in range(dep.replicas) if i not in taken), None)
            if free is None:
                self._retire(r, f"surplus: {dep.key} declares {dep.replicas} replica(s)", now)
                plan.events.append(f"{r.replica_id}: stopping, surplus to {dep.key} x{dep.replicas}")
            else:
                r.slot = free
                taken[free] = r

    def _check_failures(self, r: Replica, catalog: Catalog, now: float, ctx: Context, plan: Plan) -> None:
        if r.failed_at is not None:
            return
        for rank in sorted(r.shards):
            s = r.shards[rank]
            if s.state in (FAILED, GONE, STOPPED):
                what = {FAILED: "failed", GONE: "vanished", STOPPED: "stopped"}[s.state]
                reason = f"shard r{rank} on {s.node_id} {what}" + (f": {s.reason}" if s.reason else "")
                self._fail(r, reason, s.output_tail, now, ctx, plan)
                return
        if r.adopted and not r.complete and not ctx.in_grace:
            missing = [k for k in range(r.nnodes) if r.shards[k].node_id is None]
            self._fail(r, f"rank(s) {', '.join(map(str, missing))} not reported by any node since the "
                          "control plane started", None, now, ctx, plan)

    def _fail(self, r: Replica, reason: str, tail: str | None, now: float, ctx: Context, plan: Plan) -> None:
        r.failed_at, r.failure = now, reason
        hist = self.book.slot(r.key, r.slot if r.slot is not None else -1)
        hist.failures += 1
        delay = backoff(ctx.restart, hist.failures)
        hist.next_attempt_at = now + delay
        hist.last_failure = {"replica_id": r.replica_id, "reason": reason, "output_tail": tail, "at": now}
        plan.events.append(f"{r.replica_id}: failed ({reason}); attempt {hist.failures + 1} in {delay:g}s")

    def _progress(self, r: Replica, catalog: Catalog, nodes: Mapping[str, NodeView], now: float, plan: Plan) -> None:
        if r.state is ReplicaState.READY:
            if r.ready_since is None:
                r.ready_since = now
                plan.events.append(f"{r.replica_id}: ready")
            if r.slot is not None:
                self.book.slot(r.key, r.slot).failures = 0
            return
        r.ready_since = None
        r0 = r.shards.get(0)
        if r0 is None or r0.node_id is None or r0.state not in (STARTING, READY) or not r0.master_port:
            return
        for rank in range(1, r.nnodes):
            s = r.shards[rank]
            if s.state != WAITING or s.dispatched_at is not None or s.node_id is None:
                continue
            node = nodes.get(s.node_id)
            if node is None or not node.schedulable:
                continue
            master = r0.address or (nodes[r0.node_id].address if r0.node_id in nodes else None)
            s.spec = {**s.spec, "master_addr": master, "master_port": r0.master_port}
            s.state, s.dispatched_at, s.state_since = PENDING, now, now
            plan.actions.append(Start(s.node_id, s.spec))
            plan.events.append(f"{s.shard_id}: start on {s.node_id} GPUs {list(s.gpu_indices)} "
                               f"(rendezvous {master}:{r0.master_port})")

    def _stop_shards(self, r: Replica, nodes: Mapping[str, NodeView], plan: Plan, reason: str,
                     drain: bool = False) -> None:
        for s in r.shards.values():
            if s.released or s.node_id is None:
                continue
            if s.state == WAITING and s.dispatched_at is None:
                s.state = GONE  # never sent: nothing to stop, its GPUs are simply given back
                s.reason = "never started"
                continue
            self._stop_once(s, nodes, plan, reason, drain=drain)

    @staticmethod
    def _stop_once(s: Shard, nodes: Mapping[str, NodeView], plan: Plan, reason: str, drain: bool = False) -> None:
        node = nodes.get(s.node_id) if s.node_id else None
        if node is None or not node.connected:
            return  # its next registration will say whether it still runs
        if drain:
            if s.drain_epoch != node.epoch:
                s.drain_epoch = node.epoch
                plan.actions.append(Drain(node.node_id, s.shard_id))
        elif s.stop_epoch != node.epoch:
            s.stop_epoch = node.epoch
            plan.actions.append(Stop(node.node_id, s.shard_id, reason))

    def _clean_retired(self, nodes: Mapping[str, NodeView], now: float, plan: Plan) -> None:
        for r in [r for r in self.book.replicas.values() if r.retired]:
            drain = r.draining and r.retired_at is not None and now - r.retired_at < DRAIN_TIMEOUT
            self._stop_shards(r, nodes, plan, r.retire_reason or "retired", drain=drain)
            if r.all_released or all(s.released or s.node_id is None for s in r.shards.values()):
                self.book.remove(r.replica_id)
                plan.events.append(f"{r.replica_id}: gone ({r.retire_reason})")

    def _clean_strays(self, nodes: Mapping[str, NodeView], plan: Plan) -> None:
        for key, s in list(self.book.strays.items()):
            if s.released:
                self.book.remove_stray(key)
            else:
                self._stop_once(s, nodes, plan, s.reason or "not recognised by the control plane")

    def _retire(self, r: Replica, reason: str, now: float, draining: bool = False) -> None:
        r.retired, r.retire_reason, r.retired_at, r.draining = True, reason, now, draining

    def _place_missing(self, catalog: Catalog, dep: Deployment, nodes: Mapping[str, NodeView], now: float,
                       ctx: Context, plan: Plan, fleet: list[FleetCapacity]) -> None:
        filled = {r.slot for r in self.book.live() if (r.model, r.profile) == (dep.model, dep.profile)}
        refused: str | None = None  # once one slot does not fit this pass, no later one will
        for slot in range(dep.replicas):
            if slot in filled:
                continue
            key = (dep.key, slot)
            hist = self.book.slot(dep.key, slot)
            if ctx.in_grace:
                plan.unplaced[key] = "waiting for agents to report what they run (control-plane startup grace)"
                continue
            if now < hist.next_attempt_at:
                plan.unplaced[key] = (f"restarting in {hist.next_attempt_at - now:.0f}s "
                                      f"(failure {hist.failures}, exponential backoff)")
                continue
            if hist.needs_replacement_token:
                if ctx.damped:
                    plan.unplaced[key] = "replacement held: too many nodes unreachable at once"
                    continue
                if ctx.limiter is not None and not ctx.limiter.available(now):
                    plan.unplaced[key] = "replacement held: replacements_per_minute reached"
                    continue
            request = placement_request(catalog, dep, ctx.memory_headroom, ctx.weight_sizes)
            if request.weights_bytes is None and request.model.source in ctx.sizing:
                plan.unplaced[key] = f"waiting for the size of {request.model.source} (probing the URL)"
                continue
            if refused is not None:
                plan.unplaced[key] = refused
                continue
            if not fleet:
                fleet.append(fleet_capacity(self.book, nodes))
            result = fleet[0].place(request)
            if result.placement is None:
                plan.unplaced[key] = refused = result.reason or "no placement"
                continue
            fleet[0].take(result.placement)
            if hist.needs_replacement_token and ctx.limiter is not None:
                ctx.limiter.take(now)
            hist.needs_replacement_token = False
            self._create(catalog, dep, slot, result, hist.failures, now, plan, issued_at=ctx.wall)

    def _drain_nodes(self, catalog: Catalog, nodes: Mapping[str, NodeView], now: float, ctx: Context,
                     plan: Plan, fleet: list[FleetCapacity]) -> None:
        """Move replicas off draining nodes, make before break, one move at a time.

        A serving replica on a draining node gets a twin placed elsewhere (the
        drained node is cordoned, so placement never picks it); only once the
        twin is Ready is the old one drained (out of the router, in-flight
        requests finish, then stopped) and the twin takes its slot.  A replica
        that serves nothing has nothing to protect and is retired at once; its
        slot is refilled elsewhere the usual way.  A replica judged sick
        (``mark_sick``) moves the same way, first; with no room for its twin it
        is drained at once (the other replicas serve) and its slot refilled.
        """
        moving = False
        for twin in [r for r in self.book.live() if r.surge_for is not None]:
            old = self.book.replicas.get(twin.surge_for)
            if old is None or old.retired or old.failed_at is not None:
                self._retire(twin, f"no longer needed: {twin.surge_for} went away while it was being moved", now)
                self._stop_shards(twin, nodes, plan, twin.retire_reason or "retired")
                plan.events.append(f"{twin.replica_id}: stopping, {twin.surge_for} went away during its move")
            elif twin.state is ReplicaState.READY:
                where = ", ".join(sorted(old.nodes()))
                why = f"replaced: {old.sick}" if old.sick else f"moved off {where} (node drain)"
                self._retire(old, f"{why}: {twin.replica_id} serves in its place", now, draining=True)
                self._stop_shards(old, nodes, plan, old.retire_reason or "retired", drain=True)
                twin.slot, twin.surge_for = old.slot, None
                plan.events.append(f"{old.replica_id}: draining, {twin.replica_id} on "
                                   f"{', '.join(sorted(twin.nodes()))} is Ready in its place")
            else:
                moving = True  # starting (or failed and waiting to be retired): one move at a time
        draining = {n for n, v in nodes.items() if v.cordon == "draining"}
        sick = [r for r in self.book.live() if r.sick is not None and r.surge_for is None]
        if moving or not (draining or sick) or ctx.in_grace:
            return
        for r in sorted((r for r in self.book.live() if r.surge_for is None and (r.nodes() & draining or r.sick)),
                        key=lambda r: (r.sick is None, r.replica_id)):
            where = ", ".join(sorted(r.nodes() & draining)) or r.replica_id
            if r.state is not ReplicaState.READY:
                why = f"replaced: {r.sick}" if r.sick else f"node {where} drained"
                self._retire(r, f"{why} (the replica was not serving)", now)
                self._stop_shards(r, nodes, plan, r.retire_reason or "retired")
                plan.events.append(f"{r.replica_id}: stopping, {why} and it was not serving")
                continue
            dep = next((d for d in catalog.deployments if d.key == r.key), None)
            if dep is None or r.slot is None:
                continue  # leaving anyway: retired as uncatalogued or surplus
            hist = self.book.slot(r.key, -1)  # twins' failures back off like a slot's
            if now < hist.next_attempt_at:
                plan.drain_blocked[where] = (f"moving {r.replica_id}: its replacement failed; next attempt in "
                                             f"{hist.next_attempt_at - now:.0f}s")
                return
            if not fleet:
                fleet.append(fleet_capacity(self.book, nodes))
            result = fleet[0].place(placement_request(catalog, dep, ctx.memory_headroom, ctx.weight_sizes))
            if result.placement is None and r.sick:
                # no room for a twin: the sick replica goes first and its slot is refilled the usual way
                self._retire(r, f"replaced: {r.sick} (no room to start the replacement first)", now, draining=True)
                self._stop_shards(r, nodes, plan, r.retire_reason or "retired", drain=True)
                plan.events.append(f"{r.replica_id}: draining, {r.sick}; no room to start its replacement first")
                return
            if result.placement is None:
                plan.drain_blocked[where] = f"cannot move {r.replica_id}: {result.reason or 'no placement'}"
                return
            fleet[0].take(result.placement)
            self._create(catalog, dep, r.slot, result, r.restarts, now, plan, surge_for=r.replica_id,
                         issued_at=ctx.wall)
            why = f"{r.sick}" if r.sick else f"moving off {where} (node drain)"
            plan.events.append(f"{r.replica_id}: {why}; its replacement starts first")
            return

    def _create(self, catalog: Catalog, dep: Deployment, slot: int, result: PlacementResult, restarts: int,
                now: float, plan: Plan, surge_for: str | None = None, issued_at: float | None = None) -> None:
        assert result.placement is not None
        rid = new_replica_id(dep.model, dep.profile, slot, self._rand)
        while rid in self.book.replicas:
            rid = new_replica_id(dep.model, dep.profile, slot, None)
        model, profile = catalog.models[dep.model], catalog.profiles[dep.profile]
        nnodes = len(result.placement.shards)
        # One nonce and engine key per replica: every rank carries them, rank 0's engine enforces the key,
        # and a restarted control plane recomputes it from any rank's grant.
        nonce = new_nonce()
        key = engine_key(self.keys.signing, rid, nonce)
        r = Replica(replica_id=rid, model=dep.model, profile=dep.profile, nnodes=nnodes,
                    slot=None if surge_for else slot, shards={}, created_at=now,
                    placement_detail=result.placement.detail, restarts=restarts, surge_for=surge_for)
        for plan_shard in result.placement.shards:
            sid = shard_id(rid, plan_shard.rank)
            spec = {"shard_id": sid, "replica_id": rid, "model": model_to_dict(model),
                    "profile": profile_to_dict(profile), "rank": plan_shard.rank, "nnodes": nnodes,
                    "gpu_indices": list(plan_shard.gpu_indices), "env": dict(plan_shard.env),
                    "master_addr": None, "master_port": None, "api_key": key,
                    "grant": issue(self.keys, replica_id=rid, slot=None if surge_for else slot, model=dep.model,
                                   profile=dep.profile, node_id=plan_shard.node_id, rank=plan_shard.rank,
                                   nnodes=nnodes, issued_at=now if issued_at is None else issued_at,
                                   cp_epoch=self.cp_epoch, nonce=nonce)}
            r.shards[plan_shard.rank] = Shard(shard_id=sid, replica_id=rid, rank=plan_shard.rank,
                                              node_id=plan_shard.node_id, gpu_indices=tuple(plan_shard.gpu_indices),
                                              spec=spec, state=WAITING, state_since=now)
        self.book.add(r)
        r0 = r.shards[0]
        r0.state, r0.dispatched_at = PENDING, now
        plan.actions.append(Start(r0.node_id, r0.spec))  # type: ignore[arg-type]
        plan.events.append(f"{rid}: placed ({result.placement.rule}): {result.placement.detail}")


def endpoints(book: ReplicaBook, nodes: Mapping[str, NodeView]) -> list[dict[str, Any]]:
    """Rank-0 endpoints the router should know: Ready replicas, and draining ones marked so.

    A replica on an unreachable node stays: its engine may still serve, and
    the router finds out for itself (breaker) far faster than a lifecycle can.
    """
    out = []
    for r in sorted(book.replicas.values(), key=lambda r: r.replica_id):
        r0 = r.shards.get(0)
        if r0 is None or r0.node_id is None or not r0.port:
            continue
        if not r.retired and r.state is ReplicaState.READY:
            draining = False
        elif r.retired and r.draining and r0.state in (READY, DRAINING):
            draining = True
        else:
            continue
        host = r0.address or (nodes[r0.node_id].address if r0.node_id in nodes else None)
        if not host:
            continue
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        model = r0.spec.get("model", {})
        profile = r0.spec.get("profile", {})
        out.append({"id": r.replica_id, "model": model.get("served_name") or r.model,
                    "url": f"{r0.scheme}://{host}:{r0.port}", "replica_id": r.replica_id, "draining": draining,
                    "max_concurrency": profile.get("max_concurrency"), "api_key": r0.spec.get("api_key")})
    return out
