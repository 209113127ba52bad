"""Replicas moved off draining nodes, and sick replicas replaced: make before break, one move at a time.

A serving replica on a draining node gets a twin placed elsewhere (the
drained node is cordoned, so placement never picks it); only once the
twin is Ready is the old one drained (out of the router, in-flight
requests finish, then stopped) and the twin takes its slot.  A replica
that serves nothing has nothing to protect and is retired at once; its
slot is refilled elsewhere the usual way.  A replica judged sick
(``Reconciler.mark_sick``) moves the same way, first; with no room for its
twin it is drained at once (the other replicas serve) and its slot refilled.
"""

from __future__ import annotations

from collections.abc import Mapping

from llmgw.catalog import Catalog
from llmgw.controlplane.reconcile.placement import Issuer, Room, create, place_one, placement_request
from llmgw.controlplane.reconcile.plan import Context, NodeView, Plan
from llmgw.controlplane.reconcile.stopping import retire, stop_shards
from llmgw.controlplane.replicas import ReplicaBook, ReplicaState
from llmgw.protocol import Cordon


def drain_nodes(book: ReplicaBook, issuer: Issuer, catalog: Catalog, nodes: Mapping[str, NodeView], now: float,
                ctx: Context, plan: Plan, room: Room) -> None:
    moving = False
    for twin in [r for r in book.live() if r.surge_for is not None]:
        old = book.replicas.get(twin.surge_for)
        if old is None or old.retired or old.failed_at is not None:
            retire(twin, f"no longer needed: {twin.surge_for} went away while it was being moved", now)
            stop_shards(twin, nodes, plan, twin.retire_reason or "retired")
            plan.events.append(f"{twin.replica_id}: stopping, {twin.surge_for} went away during its move")
        elif twin.state is ReplicaState.READY:
            where = ", ".join(sorted(old.nodes()))
            why = f"replaced: {old.sick}" if old.sick else f"moved off {where} (node drain)"
            retire(old, f"{why}: {twin.replica_id} serves in its place", now, draining=True)
            stop_shards(old, nodes, plan, old.retire_reason or "retired", drain=True)
            twin.slot, twin.surge_for = old.slot, None
            plan.events.append(f"{old.replica_id}: draining, {twin.replica_id} on "
                               f"{', '.join(sorted(twin.nodes()))} is Ready in its place")
        else:
            moving = True  # starting (or failed and waiting to be retired): one move at a time
    draining = {n for n, v in nodes.items() if v.cordon == Cordon.DRAINING}
    sick = [r for r in book.live() if r.sick is not None and r.surge_for is None]
    if moving or not (draining or sick) or ctx.in_grace:
        return
    for r in sorted((r for r in book.live() if r.surge_for is None and (r.nodes() & draining or r.sick)),
                    key=lambda r: (r.sick is None, r.replica_id)):
        where = ", ".join(sorted(r.nodes() & draining)) or r.replica_id
        if r.state is not ReplicaState.READY:
            why = f"replaced: {r.sick}" if r.sick else f"node {where} drained"
            retire(r, f"{why} (the replica was not serving)", now)
            stop_shards(r, nodes, plan, r.retire_reason or "retired")
            plan.events.append(f"{r.replica_id}: stopping, {why} and it was not serving")
            continue
        dep = next((d for d in catalog.deployments if d.key == r.key), None)
        if dep is None or r.slot is None:
            continue  # leaving anyway: retired as uncatalogued or surplus
        hist = book.slot(r.key, -1)  # twins' failures back off like a slot's
        if now < hist.next_attempt_at:
            plan.drain_blocked[where] = (f"moving {r.replica_id}: its replacement failed; next attempt in "
                                         f"{hist.next_attempt_at - now:.0f}s")
            return
        fleet = room.get()
        result = place_one(fleet, book, placement_request(catalog, dep, ctx.memory_headroom, ctx.weight_sizes))
        if result.placement is None and r.sick:
            # no room for a twin: the sick replica goes first and its slot is refilled the usual way
            retire(r, f"replaced: {r.sick} (no room to start the replacement first)", now, draining=True)
            stop_shards(r, nodes, plan, r.retire_reason or "retired", drain=True)
            plan.events.append(f"{r.replica_id}: draining, {r.sick}; no room to start its replacement first")
            return
        if result.placement is None:
            plan.drain_blocked[where] = f"cannot move {r.replica_id}: {result.reason or 'no placement'}"
            return
        fleet.take(result.placement)
        create(book, issuer, catalog, dep, r.slot, result, r.restarts, now, plan, surge_for=r.replica_id,
               issued_at=ctx.wall)
        why = f"{r.sick}" if r.sick else f"moving off {where} (node drain)"
        plan.events.append(f"{r.replica_id}: {why}; its replacement starts first")
        return
