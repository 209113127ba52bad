"""What the API shows: nodes, replicas, the catalog and placement explanations, as JSON.

Times inside the control plane are monotonic; people get ages in seconds
("how long ago"), which mean the same thing on any clock.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from llmgw.catalog import Catalog
from llmgw.controlplane.autoscale import SEEN
from llmgw.controlplane.listquery import ListQuery, page
from llmgw.controlplane.reconcile.placement import placed_nodes
from llmgw.controlplane.reconciler import capacities, placement_request
from llmgw.controlplane.replicas import Replica, Shard, model_to_dict, profile_to_dict
from llmgw.controlplane.state import ControlPlane
from llmgw.placement import format_result, place_many
from llmgw.placement.memory import gib
from llmgw.protocol import Cordon


def _ago(now: float, t: float | None) -> float | None:
    return None if t is None else round(max(0.0, now - t), 3)


def nodes_view(cp: ControlPlane, query: ListQuery = ListQuery()) -> dict[str, Any]:
    """Every node, or the page and states ``query`` asks for; ``next`` is the ``after`` of the next page."""
    now = cp.clock()
    ids, after = page(sorted(cp.nodes), query, lambda n: cp.nodes[n].clock.state.value)
    out = [node_view(cp, node_id, now) for node_id in ids]
    ev = cp.evaluation
    grace_left = cp.timers.grace_left(now, cp.settings.lifecycle)
    return {"nodes": out, "next": after, "fleet": {
        "startup_grace_left_s": round(grace_left, 3),
        "unreachable_share": round(ev.unreachable_share, 4),
        "damped": ev.damped,
        "hold_reason": ev.hold_reason,
        **timings(cp),
    }}


def node_view(cp: ControlPlane, node_id: str, now: float) -> dict[str, Any]:
    """One node, as ``GET /v1/nodes/{node_id}`` answers it and as each element of ``GET /v1/nodes``."""
    rec = cp.nodes[node_id]
    claimed = cp.reconciler.book.claimed(node_id)
    gpus = [{"index": g.index, "name": g.name, "memory_bytes": g.memory_bytes, "uuid": g.uuid,
             "nvlink_peers": list(g.nvlink_peers), "shard": claimed.get(g.index)} for g in rec.inventory.gpus]
    return {
        "node_id": node_id,
        "state": rec.clock.state.value,
        "state_for_s": _ago(now, rec.clock.since),
        "reason": rec.last_reason,
        "connected": rec.connected,
        "epoch": rec.epoch,
        "last_seen_s": _ago(now, rec.clock.last_seen),
        "address": rec.address,
        "agent_version": rec.agent_version,
        "boot_id": rec.boot_id,
        "certificate": rec.certificate,
        "registrations": rec.registrations,
        **node_cordon_view(cp, node_id),
        "gpus_total": len(gpus),
        "gpus_free": sum(1 for g in gpus if g["shard"] is None),
        "gpus": gpus,
        "nvlink_known": rec.inventory.nvlink_known,
        "fabrics": [f.to_dict() for f in rec.inventory.fabrics],
        "hardware": rec.inventory.to_dict(),
    }


def node_or_none(cp: ControlPlane, node_id: str) -> dict[str, Any] | None:
    """``GET /v1/nodes/{node_id}``: the node, or None when no node of that id has registered."""
    return node_view(cp, node_id, cp.clock()) if node_id in cp.nodes else None


def replica_or_none(cp: ControlPlane, replica_id: str) -> dict[str, Any] | None:
    """``GET /v1/replicas/{replica_id}``: the replica, or None when the control plane knows none of that id."""
    r = cp.reconciler.book.replicas.get(replica_id)
    return None if r is None else replica_view(cp, r, cp.clock())


def some_of(ids: Iterable[str], at_most: int = 10) -> str:
    """``a, b, c`` or ``a, b, ... and 9,990 more``: an error names a few, not a 10,000-node fleet."""
    ordered = sorted(ids)
    if not ordered:
        return "none"
    more = len(ordered) - at_most
    return ", ".join(ordered[:at_most]) + (f" and {more:,} more" if more > 0 else "")


def node_cordon_view(cp: ControlPlane, node_id: str) -> dict[str, Any]:
    """A node's cordon and, while it drains, how many replicas are still on it and why a move waits."""
    rec = cp.nodes[node_id]
    out: dict[str, Any] = {"node_id": node_id, "cordon": rec.cordon}
    if rec.cordon == Cordon.DRAINING:
        on = cp.reconciler.book.replica_ids_on(node_id)  # the book's node index: no walk of the fleet
        out["replicas_left"] = len(on)
        out["drained"] = not on
        out["drain_blocked"] = next((why for where, why in cp.drain_blocked.items()
                                     if node_id in where.split(", ")), None)
    return out


def summary_view(cp: ControlPlane) -> dict[str, Any]:
    """The fleet in counts: cheap enough to poll every second at 10,000 nodes.

    ``/v1/nodes`` and ``/v1/replicas`` carry every node's hardware and every
    shard (tens of megabytes at that size); a dashboard, a rollout waiting
    for Ready, or a benchmark needs only how many are in which state.
    """
    book = cp.reconciler.book
    nodes: dict[str, int] = {}
    connected = gpus = 0
    for rec in cp.nodes.values():
        nodes[rec.clock.state.value] = nodes.get(rec.clock.state.value, 0) + 1
        connected += rec.connected
        gpus += len(rec.inventory.gpus)
    replicas: dict[str, int] = {}
    claimed = 0
    for r in book.replicas.values():
        replicas[r.state.value] = replicas.get(r.state.value, 0) + 1
    for shards in (book.shards_on(n) for n in cp.nodes):
        claimed += len({g for s in shards if not s.released for g in s.gpu_indices})
    ev = cp.evaluation
    return {
        "nodes": {"total": len(cp.nodes), "connected": connected, "by_state": nodes},
        "replicas": {"total": len(book.replicas), "by_state": replicas,
                     "desired": sum(cp.replica_counts.get(d.key, d.replicas) for d in cp.catalog.deployments),
                     "unplaced": len(cp.unplaced)},
        "gpus": {"total": gpus, "claimed": claimed, "claimed_twice": len(book.double_claims())},
        "stopping_unrecognised": len(book.strays),
        "fleet": {"unreachable_share": round(ev.unreachable_share, 4), "damped": ev.damped,
                  "in_grace": ev.in_grace, "hold_reason": ev.hold_reason, **timings(cp)},
    }


def timings(cp: ControlPlane) -> dict[str, float]:
    """The lifecycle timings in force (stretched for a large fleet), as the nodes were told."""
    lc = cp.lifecycle()
    return {"heartbeat_interval_s": round(lc.heartbeat_interval, 3), "unreachable_after_s": round(lc.unreachable_after, 3),
            "lost_after_s": round(lc.lost_after, 3)}


def shard_view(s: Shard, now: float) -> dict[str, Any]:
    return {
        "shard_id": s.shard_id,
        "rank": s.rank,
        "node_id": s.node_id,
        "gpus": list(s.gpu_indices),
        "state": s.state,
        "state_for_s": _ago(now, s.state_since),
        "reason": s.reason,
        "output_tail": s.output_tail,
        "pid": (s.process or {}).get("pid"),
        "process": s.process,
        "port": s.port,
        "master_port": s.master_port,
        "side_port": s.side_port,
        "address": s.address,
        "scheme": s.scheme if s.port else None,
        "engine_version": s.engine_version,
        "adopted": s.adopted,
        "progress": None if s.progress is None else {k: v for k, v in s.progress.items() if k != "at"},
    }


def replica_view(cp: ControlPlane, r: Replica, now: float) -> dict[str, Any]:
    book = cp.reconciler.book
    hist = book.slots.get((r.key, r.slot)) if r.slot is not None else None
    r0 = r.shards.get(0)
    endpoint = None
    if r0 is not None and r0.port and r0.node_id and not r0.released:
        host = r0.address or (cp.nodes[r0.node_id].address if r0.node_id in cp.nodes else None)
        if host and ":" in host and not host.startswith("["):
            host = f"[{host}]"
        endpoint = f"{r0.scheme}://{host}:{r0.port}" if host else None
    return {
        "replica_id": r.replica_id,
        "model": r.model,
        "profile": r.profile,
        "slot": r.slot,
        "state": r.state.value,
        "reason": r.failure if r.failed_at is not None else r.retire_reason,
        "adopted": r.adopted,
        "age_s": _ago(now, r.created_at),
        "ready_for_s": _ago(now, r.ready_since),
        "restarts": r.restarts,
        "replaces": r.surge_for,
        "sick": r.sick,
        "ejections": ejections_view(cp, r.replica_id, now),
        "placement": r.placement_detail,
        "endpoint": endpoint,
        # the engine release rank 0 reports (vLLM's /version ...), once it has been Ready
        "engine_version": r0.engine_version if r0 is not None else None,
        # prompts and the engine key cross the node network in clear text to this replica
        "clear_text": None if endpoint is None else r0.scheme != "https",
        # what its engine caches, as route keys its agent relays (a profile with kv_events)
        "route_keys": cp.route_keys.view(r.replica_id, now),
        "retry_in_s": (round(max(0.0, hist.next_attempt_at - now), 3)
                       if hist is not None and r.failed_at is not None else None),
        "last_failure": None if hist is None or hist.last_failure is None else {
            **{k: v for k, v in hist.last_failure.items() if k != "at"},
            "ago_s": _ago(now, hist.last_failure.get("at"))},
        "shards": [shard_view(r.shards[k], now) for k in sorted(r.shards)],
    }


def ejections_view(cp: ControlPlane, replica_id: str, now: float) -> dict[str, Any] | None:
    """Which routers report the replica ejected, since when, and what the control plane makes of it."""
    reports = cp.ejections.for_replica(replica_id)
    if not reports:
        return None
    v = cp.ejection_verdicts.get(replica_id)
    return {"routers": [rep.view(now) for rep in reports], "verdict": v.reason if v else None,
            "routers_needed": v.needed if v else None}


def replicas_view(cp: ControlPlane, query: ListQuery = ListQuery()) -> dict[str, Any]:
    """Every replica by deployment and slot, or (``limit``, ``after``) a page of them in replica id order.

    ``unplaced`` and ``stopping_unrecognised`` (a few entries, bounded by the
    catalog) come whole with every page.
    """
    now = cp.clock()
    book = cp.reconciler.book
    after = None
    if query.paged:
        ids, after = page(sorted(book.replicas), query, lambda rid: book.replicas[rid].state.value)
        reps = [book.replicas[rid] for rid in ids]
    else:
        reps = sorted((r for r in book.replicas.values() if query.states is None or r.state.value in query.states),
                      key=lambda r: (r.model, r.profile, r.slot if r.slot is not None else -1, r.retired, r.replica_id))
    return {
        "replicas": [replica_view(cp, r, now) for r in reps],
        "next": after,
        "unplaced": [{"model": k.split("/")[0], "profile": k.split("/")[1], "slot": slot, "reason": why,
                      "last_failure": (lambda h: None if h is None or h.last_failure is None else {
                          k2: v for k2, v in h.last_failure.items() if k2 != "at"})(book.slots.get((k, slot)))}
                     for (k, slot), why in sorted(cp.unplaced.items())],
        "stopping_unrecognised": [shard_view(s, now) for s in book.strays.values()],
    }


def catalog_view(cp: ControlPlane) -> dict[str, Any]:
    cat: Catalog = cp.catalog
    return {
        "source": cp.loaded.source,
        "loaded_ago_s": round(max(0.0, time.time() - cp.loaded.loaded_at), 3),
        "models": [{**model_to_dict(m), "weights": cp.sizes.describe(m)} for m in cat.models.values()],
        "profiles": [profile_to_dict(p) for p in cat.profiles.values()],
        "deployments": [{"model": d.model, "profile": d.profile, "replicas": d.replicas, **autoscale_view(cp, d)}
                        for d in cat.deployments],
    }


# ---- autoscaled deployments in the catalog view (additive: keys only on autoscaled deployments) ----
def autoscale_view(cp: ControlPlane, dep: Any) -> dict[str, Any]:
    """An autoscaled deployment's bounds as the control plane holds them and where its count stands.

    The inventory plugin reads the catalog once; without this an operator's ``ansible-inventory``
    (and drift.yml comparing declared bounds) would need ``/v1/explain`` per model, which also runs
    placement for every empty slot. ``autoscale`` is the block with its defaults filled in;
    ``scaling.current`` the replicas not retired, ``desired`` the count the reconciler places (what
    the budget granted, if any), ``reason`` the rule's last reason (``lent`` while its GPUs are lent,
    ``autoscale_lend``), ``lead_s`` a new replica's start as
    measured (what a rising signal is followed ahead by) and ``budget`` the budget's grant.
    """
    policy = dep.autoscale
    if policy is None:
        return {}
    block = {k: getattr(policy, k) for k in ("min", "max", "signal", "target", "stable_window", "panic_window",
                                             "panic_threshold", "tolerance", "scale_down_cooldown", "max_step",
                                             "headroom", "max_scale_up_rate", "scale_down_stabilization",
                                             "priority")}
    if policy.sleep is not None:
        block["sleep"] = {"after": policy.sleep.after, "level": policy.sleep.level, "lend": policy.sleep.lend}
    d = cp.autoscaler.decision(dep.key)
    g = cp.autoscaler.grant(dep.key)
    return {"autoscale": block, "scaling": {
        "current": sum(1 for r in cp.reconciler.book.live() if r.key == dep.key),
        "desired": cp.replica_counts.get(dep.key, policy.clamp(dep.replicas)),
        "reason": scaling_reason(cp, dep.key),
        "wanted": d.wanted if d is not None else None,
        "lead_s": d.lead if d is not None else None,
        "engine_signal": engine_signal_view(cp.autoscaler.sample(dep.key)),
        "budget": None if g is None else {"desired": g.desired, "granted": g.granted, "reason": g.reason}}}


def scaling_reason(cp: ControlPlane, key: str) -> str:
    """Why an autoscaled deployment's count is what it is: ``lent`` while its GPUs are lent
    (``autoscale_lend``), else the rule's last reason, ``start`` before its first decision."""
    if key in cp.lending.loans:
        return "lent"
    d = cp.autoscaler.decision(key)
    return d.reason if d is not None else "start"


def engine_signal_view(sample: Any) -> dict[str, Any] | None:
    """What the autoscaler last saw of a deployment's engine signal (None: it scales on the routers' load):
    ``total`` over its Ready replicas (None while ``partial``: some Ready replica has no fresh value)."""
    if sample is None:
        return None
    return {"signal": sample.signal, "total": sample.total, "reporting": sample.reporting,
            "replicas": sample.replicas, "partial": sample.partial}


def engine_signal_line(sample: Any) -> str:
    """The explain line's note on an engine signal's last sample ('' for the routers' load)."""
    if sample is None:
        return ""
    if sample.replicas == 0:
        return "; engines: no Ready replica to read, the count holds"
    if sample.partial:
        return (f"; engines: {sample.reporting} of {sample.replicas} Ready replica(s) reporting, "
                "the count holds until all do")
    return f"; engines now: {sample.total:.2f} {SEEN[sample.signal]} ({sample.replicas} replica(s) reporting)"


def weights_line(weights: dict[str, Any], source: str, cp: ControlPlane) -> str:
    """Where the size placement used came from, for people."""
    if weights["bytes"] is not None:
        return f"weights: {gib(weights['bytes'])} ({weights['source']})"
    if source in cp.sizes.probing:
        return f"weights: size unknown yet (probing {source})"
    why = cp.sizes.warned.get(source)
    return "weights: size unknown (no size_bytes declared" + (f"; {source}: {why})" if why else ")")


def _history_lines(book: Any, key: str, slot: int, views: Mapping[str, Any]) -> str:
    """The slot's last failure and every node's withheld GPUs: why a replica moved, or cannot go somewhere."""
    out = ""
    hist = book.slots.get((key, slot))
    lf = hist.last_failure if hist is not None else None
    if lf:
        out += f"\n  last failure ({lf.get('replica_id')}): {lf.get('reason')}"
    for node_id, v in sorted(views.items()):
        if v.inventory.sick_gpus:
            out += f"\n  {node_id}: {v.inventory.gpu_reason}"
    return out


def explain_view(cp: ControlPlane, model: str) -> dict[str, Any] | None:
    """Where each declared replica of ``model`` runs, or where it would go and why not.

    Slots that have a replica say where it is; empty slots are placed, in
    order, on what is free now, exactly as the reconciler would do it.
    """
    cat = cp.catalog
    deps = [d for d in cat.deployments if model in (d.model, cat.models[d.model].served_name)]
    if not deps and model not in cat.models:
        return None
    book = cp.reconciler.book
    views = cp.node_views()
    report: list[dict[str, Any]] = []
    pending = []
    for dep in deps:
        live = {r.slot: r for r in book.live() if (r.model, r.profile) == (dep.model, dep.profile)}
        for slot in range(cp.replica_counts.get(dep.key, dep.replicas)):
            label = f"{dep.key}#{slot}"
            r = live.get(slot)
            if r is not None:
                where = "; ".join(f"r{s.rank} on {s.node_id} GPUs {','.join(map(str, s.gpu_indices))} ({s.state})"
                                  for s in sorted(r.shards.values(), key=lambda s: s.rank))
                v = cp.ejection_verdicts.get(r.replica_id)
                health = (f"; being replaced: {r.sick}" if r.sick else
                          f"; routers report it ejected: {v.reason}" if v is not None else "")
                placed = f"; {r.placement_detail}" if dep.role and r.placement_detail else ""  # role and path
                report.append({"replica": label, "placed": True, "running": r.replica_id, "state": r.state.value,
                               "text": f"{dep.key}: running as {r.replica_id} ({r.state.value}): {where}{health}"
                                       + placed
                                       + _history_lines(book, dep.key, slot, views),
                               "placement": None, "reason": r.sick or (v.reason if v is not None else None),
                               "nodes": [],
                               # what its engine caches, as its agent relays it (None: publishes nothing)
                               "route_keys": cp.route_keys.view(r.replica_id, cp.clock())})
            else:
                pending.append((label, dep))
    if pending:
        requests = [placement_request(cat, dep, cp.settings.memory_headroom, cp.sizes.bytes) for _, dep in pending]
        results = place_many(requests, capacities(book, views), placed_nodes(book))
        for (label, dep), req, res in zip(pending, requests, results):
            slot = int(label.rsplit("#", 1)[1])
            held = cp.unplaced.get((dep.key, slot))
            weights = cp.sizes.describe(req.model)
            report.append({
                "replica": label,
                "placed": res.ok,
                "running": None,
                "state": None,
                "text": (format_result(res, req) + f"\n  {weights_line(weights, req.model.source, cp)}"
                         + (f"\n  (now: {held})" if held else "") + _history_lines(book, dep.key, slot, views)),
                "weights": weights,
                "placement": None if res.placement is None else {
                    "rule": res.placement.rule, "detail": res.placement.detail, "fabric": res.placement.fabric,
                    "shards": [{"node": s.node_id, "rank": s.rank, "gpus": list(s.gpu_indices), "env": s.env}
                               for s in res.placement.shards]},
                "reason": res.reason,
                "held": held,
                "nodes": [{"node": v.node_id, "ok": v.ok, "reason": v.reason} for v in res.verdicts],
            })
    names = {d.model for d in deps} | ({model} if model in cat.models else set())
    refused = [{"shard_id": s.shard_id, "node_id": s.node_id, "state": s.state, "reason": s.reason}
               for s in book.strays.values() if s.spec.get("model", {}).get("name") in names]
    scaling = []
    for dep in deps:
        d = cp.autoscaler.decision(dep.key)
        if dep.autoscale is not None:
            desired = cp.replica_counts.get(dep.key, dep.autoscale.clamp(dep.replicas))
            g = cp.autoscaler.grant(dep.key)
            text = (d.explain(dep.autoscale) if d is not None else
                    f"autoscale {dep.autoscale.min}..{dep.autoscale.max}: {desired} replica(s) "
                    "(start; measuring after the startup grace)")
            sample = cp.autoscaler.sample(dep.key)
            text += engine_signal_line(sample)
            loan = cp.lending.loans.get(dep.key)
            if loan is not None:
                text += (f"; lent: its GPUs went to {loan.borrower} while every replica slept (back from zero "
                         "replicas on its next request)")
            scaling.append({"deployment": dep.key, "desired": desired,
                            "reason": scaling_reason(cp, dep.key),
                            "signal": None if d is None else {"stable": d.stable, "panic": d.panic},
                            "engine_signal": engine_signal_view(sample),
                            "budget": None if g is None else {"desired": g.desired, "granted": g.granted,
                                                              "reason": g.reason, "winners": list(g.winners)},
                            "text": text if g is None else f"{text}; {g.explain()}"})
    return {"model": model, "replicas": report, "refused": refused, "autoscale": scaling}
