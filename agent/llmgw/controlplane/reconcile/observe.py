"""Agents' reports into the book: registrations (with adoption by grant), transitions, progress.

Observations only update the book; what to do about them is the passes'.
The fleet is authoritative about what runs:

- a shard an agent reports that we do not know is *adopted* only with a
  grant this control plane's secret verifies, issued for that very node,
  replica, rank, model and profile (``grants``); a claim without one is
  never routed, never competes for a slot, and is told to stop.  Its engine
  key is recomputed from the grant, never taken from the report;
- a shard we believe runs on a node that its registration does not list is
  let go (a registration follows a fresh connection, so anything dispatched
  over an earlier one and not reported is not running); an empty list is
  news, not nothing;
- only what is not recognised is disowned: a reconnecting agent's serving
  shards are taken back as they are, never stopped.
"""

from __future__ import annotations

from typing import Any

from llmgw.controlplane.grants import Claim, GrantKeys, Verdict, engine_key, verify
from llmgw.controlplane.replicas import (
    ENDED_STATES,
    FETCHING,
    GONE,
    PENDING,
    READY,
    RUNNING_STATES,
    STARTING,
    WAITING,
    Replica,
    ReplicaBook,
    Shard,
    shard_id,
    slot_of,
)


def claim_of(node_id: str, spec: dict[str, Any]) -> Claim:
    """What a reported spec claims, for ``grants.verify``."""
    return Claim(node_id=node_id, replica_id=spec["replica_id"], rank=spec["rank"], nnodes=spec["nnodes"],
                 model=spec["model"]["name"], profile=spec["profile"]["name"])


def observe_register(book: ReplicaBook, keys: GrantKeys, node_id: str, reports: list[dict[str, Any]], now: float,
                     refused: list[str] | None = None) -> list[str]:
    """A node registered and listed every shard it runs (possibly none).

    Claims refused for want of a valid grant are also appended to
    ``refused`` (the caller logs them as errors).
    """
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
            apply_report(known, rep, now)
            continue
        if state in ENDED_STATES:
            continue  # nothing runs, nothing is held
        verdict = check_grant(keys, node_id, spec)
        shard = shard_from_report(node_id, rep, now)
        if not verdict.ok:
            shard.reason = f"refused: {verdict.reason}"
            book.add_stray(shard)
            line = (f"{sid} on {node_id}: refused, not adopted ({verdict.reason}): never routed; will stop it")
            events.append(line)
            if refused is not None:
                refused.append(line)
            continue
        shard.spec = granted_spec(spec, verdict)
        r = book.replicas.get(spec["replica_id"])
        if r is None:
            r = adopt_candidate(book, spec, now)
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


def observe_status(book: ReplicaBook, node_id: str, msg: dict[str, Any], now: float) -> list[str]:
    """A shard changed state on ``node_id`` (only shards of that node count)."""
    sid, state = msg["shard_id"], msg["state"]
    s = book.find(node_id, sid)
    if s is None:
        if state not in RUNNING_STATES:
            return []
        stray = Shard(shard_id=sid, replica_id=msg.get("replica_id") or sid.split("/")[0], rank=0,
                      node_id=node_id, gpu_indices=(), spec={}, state=state, state_since=now,
                      reason="reported by its agent but never started or adopted here")
        book.add_stray(stray)
        return [f"{sid} on {node_id}: unknown shard reported {state}: will stop it"]
    if state != s.state:
        s.state, s.state_since, s.progress = state, now, None
    for key in ("reason", "output_tail"):
        if key in msg:
            setattr(s, key, msg[key])
    if state == READY:
        s.reason, s.output_tail = None, None
    for key in ("process", "port", "master_port", "address", "side_port"):
        if msg.get(key) is not None:
            setattr(s, key, msg[key])
    if msg.get("port") is not None:  # each report of an endpoint says how it serves (absent: http)
        s.scheme = msg.get("scheme", "http")
    if msg.get("engine_version") is not None:
        s.engine_version = msg["engine_version"]
    slept = ""
    if "sleeping" in msg:
        s.sleep_known = True
    if state != READY or "sleeping" in msg:  # scale to sleep: only a Ready engine sleeps
        was, s.sleeping = s.sleeping, state == READY and bool(msg.get("sleeping"))
        slept = "" if was == s.sleeping else (", asleep" if s.sleeping else ", awake")
    return [f"{sid} on {node_id}: {state}{slept}" + (f" ({msg['reason']})" if msg.get("reason") else "")]


def observe_progress(book: ReplicaBook, node_id: str, msg: dict[str, Any], now: float) -> None:
    """Download progress: shown under the shards waiting on it, never a transition."""
    if msg.get("shard_ids"):
        targets = [book.find(node_id, sid) for sid in msg["shard_ids"]]
    else:
        targets = [s for s in book.shards_on(node_id)
                   if s.state in (PENDING, FETCHING, STARTING)
                   and s.spec.get("model", {}).get("source") == msg["source"]]
    info = {k: msg.get(k) for k in ("source", "file", "bytes_done", "bytes_total", "rate_bps", "note")}
    info["at"] = now
    for s in targets:
        # Only a shard still on its way up: a report that crossed a real
        # transition must not pin a stale line under a serving shard.
        if s is not None and not s.released and s.state in (PENDING, FETCHING, STARTING):
            s.progress = info


def check_grant(keys: GrantKeys, node_id: str, spec: dict[str, Any]) -> Verdict:
    """Whether ``spec``'s grant is this control plane's, for exactly this node and shard."""
    if spec["shard_id"] != shard_id(spec["replica_id"], spec["rank"]):
        return Verdict(False, f"shard id {spec['shard_id']!r} is not rank {spec['rank']} of "
                              f"{spec['replica_id']!r}")
    return verify(keys, spec.get("grant"), claim_of(node_id, spec))


def granted_spec(spec: dict[str, Any], verdict: Verdict) -> dict[str, Any]:
    """The reported spec with the engine key recomputed from its (verified) grant."""
    assert verdict.secret is not None
    return {**spec, "api_key": engine_key(verdict.secret, spec["replica_id"], spec["grant"]["nonce"])}


def shard_from_report(node_id: str, rep: dict[str, Any], now: float) -> Shard:
    spec = rep["spec"]
    s = Shard(shard_id=spec["shard_id"], replica_id=spec["replica_id"], rank=spec["rank"], node_id=node_id,
              gpu_indices=tuple(spec["gpu_indices"]), spec=spec, adopted=True, state_since=now)
    apply_report(s, rep, now)
    return s


def apply_report(s: Shard, rep: dict[str, Any], now: float) -> None:
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
    # a new stream: whether rank 0 sleeps is known again only once its agent says so
    s.sleep_known = "sleeping" in rep
    if s.sleep_known:
        s.sleeping = rep["state"] == READY and bool(rep["sleeping"])


def adopt_candidate(book: ReplicaBook, spec: dict[str, Any], now: float) -> Replica:
    """The replica a granted report belongs to, rebuilt with its ranks still to be reported."""
    rid = spec["replica_id"]
    model, profile = spec["model"]["name"], spec["profile"]["name"]
    r = Replica(replica_id=rid, model=model, profile=profile, nnodes=spec["nnodes"],
                slot=slot_of(rid, model, profile), shards={}, created_at=now, adopted=True)
    for rank in range(spec["nnodes"]):
        r.shards[rank] = Shard(shard_id=shard_id(rid, rank), replica_id=rid, rank=rank, node_id=None,
                               gpu_indices=(), spec={}, state=WAITING, state_since=now)
    book.add(r)
    return r
