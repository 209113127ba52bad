"""Missing slots placed: what a replica needs, where it fits, and the replica created with its grants.

A GPU is held from the moment a ``start`` is dispatched until the agent says
the shard ended, so placement can never hand it out twice: the fleet's free
GPUs (``FleetCapacity``) are counted once a pass, when first needed, and
every placement made in the pass is taken from them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from llmgw.catalog import Catalog, Deployment, weights_bytes
from llmgw.controlplane.capacity import FleetCapacity
from llmgw.controlplane.grants import GrantKeys, engine_key, issue, new_nonce
from llmgw.controlplane.reconcile.plan import Context, NodeView, Plan, Start
from llmgw.controlplane.replicas import (
    PENDING,
    WAITING,
    Replica,
    ReplicaBook,
    Shard,
    model_to_dict,
    new_replica_id,
    profile_to_dict,
    shard_id,
)
from llmgw.placement import NodeCapacity, PlacementRequest, PlacementResult


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


def placed_nodes(book: ReplicaBook) -> dict[tuple[str, str], set[str]]:
    """(model, profile) -> the nodes its live replicas hold shards on: where a prefill/decode peer runs."""
    out: dict[tuple[str, str], set[str]] = {}
    for r in book.live():
        out.setdefault((r.model, r.profile), set()).update(s.node_id for s in r.shards.values() if s.node_id)
    return out


def place_one(fleet: FleetCapacity, book: ReplicaBook, request: PlacementRequest) -> PlacementResult:
    """Where one replica goes; a replica of a prefill/decode group only where its peers can reach it."""
    if request.profile.kv_transfer is None:
        return fleet.place(request)
    return fleet.place_paired(request, placed_nodes(book))


class Room:
    """The fleet's free GPUs for one pass, counted on first need: most passes place nothing."""

    def __init__(self, book: ReplicaBook, nodes: Mapping[str, NodeView]):
        self._book, self._nodes = book, nodes
        self._fleet: FleetCapacity | None = None

    @property
    def counted(self) -> bool:
        return self._fleet is not None

    def get(self) -> FleetCapacity:
        if self._fleet is None:
            self._fleet = fleet_capacity(self._book, self._nodes)
        return self._fleet


@dataclass(frozen=True)
class Issuer:
    """Where a new replica's id and grants come from: this control plane's keys and run."""

    keys: GrantKeys
    cp_epoch: int = 0
    rand: Callable[[], str] | None = None


def place_missing(book: ReplicaBook, issuer: Issuer, catalog: Catalog, dep: Deployment, now: float,
                  ctx: Context, plan: Plan, room: Room) -> None:
    """Place every slot of ``dep`` no live replica fills, or say in ``plan.unplaced`` why it waits."""
    filled = {r.slot for r in book.live() if (r.model, r.profile) == (dep.model, dep.profile)}
    refused: str | None = None  # once one slot does not fit this pass, no later one will
    for slot in range(dep.replicas):
        if slot in filled:
            continue
        key = (dep.key, slot)
        hist = book.slot(dep.key, slot)
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
        fleet = room.get()
        result = place_one(fleet, book, request)
        if result.placement is None:
            plan.unplaced[key] = refused = result.reason or "no placement"
            continue
        fleet.take(result.placement)
        if hist.needs_replacement_token and ctx.limiter is not None:
            ctx.limiter.take(now)
        hist.needs_replacement_token = False
        create(book, issuer, catalog, dep, slot, result, hist.failures, now, plan, issued_at=ctx.wall)


def create(book: ReplicaBook, issuer: Issuer, catalog: Catalog, dep: Deployment, slot: int, result: PlacementResult,
           restarts: int, now: float, plan: Plan, surge_for: str | None = None,
           issued_at: float | None = None) -> None:
    """A new replica where ``result`` placed it, its rank 0 started; with ``surge_for``, a twin with no slot yet."""
    assert result.placement is not None
    rid = new_replica_id(dep.model, dep.profile, slot, issuer.rand)
    while rid in book.replicas:
        rid = new_replica_id(dep.model, dep.profile, slot, None)
    model, profile = catalog.models[dep.model], catalog.profiles[dep.profile]
    nnodes = len(result.placement.shards)
    # One nonce and engine key per replica: every rank carries them, rank 0's engine enforces the key,
    # and a restarted control plane recomputes it from any rank's grant.
    nonce = new_nonce()
    key = engine_key(issuer.keys.signing, rid, nonce)
    r = Replica(replica_id=rid, model=dep.model, profile=dep.profile, nnodes=nnodes,
                slot=None if surge_for else slot, shards={}, created_at=now,
                placement_detail=result.placement.detail, restarts=restarts, surge_for=surge_for)
    for plan_shard in result.placement.shards:
        sid = shard_id(rid, plan_shard.rank)
        spec: dict[str, Any] = {
            "shard_id": sid, "replica_id": rid, "model": model_to_dict(model),
            "profile": profile_to_dict(profile), "rank": plan_shard.rank, "nnodes": nnodes,
            "gpu_indices": list(plan_shard.gpu_indices), "env": dict(plan_shard.env),
            "master_addr": None, "master_port": None, "api_key": key,
            "grant": issue(issuer.keys, replica_id=rid, slot=None if surge_for else slot, model=dep.model,
                           profile=dep.profile, node_id=plan_shard.node_id, rank=plan_shard.rank,
                           nnodes=nnodes, issued_at=now if issued_at is None else issued_at,
                           cp_epoch=issuer.cp_epoch, nonce=nonce)}
        if dep.autoscale is not None and dep.autoscale.sleep is not None:
            spec["sleep_mode"] = True  # only when set: an agent that predates it refuses the key
        r.shards[plan_shard.rank] = Shard(shard_id=sid, replica_id=rid, rank=plan_shard.rank,
                                          node_id=plan_shard.node_id, gpu_indices=tuple(plan_shard.gpu_indices),
                                          spec=spec, state=WAITING, state_since=now)
    book.add(r)
    r0 = r.shards[0]
    r0.state, r0.dispatched_at = PENDING, now
    plan.actions.append(Start(r0.node_id, r0.spec))  # type: ignore[arg-type]
    plan.events.append(f"{rid}: placed ({result.placement.rule}): {result.placement.detail}")
