"""A shard that failed, vanished or stopped fails its replica; its slot restarts after a backoff.

The failed replica's shards are stopped at once; it is retired (and its
slot placed again) only when the slot's backoff has run out, so the
failure stays visible until then.
"""

from __future__ import annotations

from collections.abc import Mapping

from llmgw.controlplane.reconcile.plan import Context, NodeView, Plan
from llmgw.controlplane.reconcile.stopping import retire, stop_shards
from llmgw.controlplane.replicas import FAILED, GONE, STOPPED, Replica, ReplicaBook
from llmgw.settings import RestartPolicy


def backoff(policy: RestartPolicy, failures: int) -> float:
    """Seconds before the next attempt after ``failures`` consecutive failures."""
    if failures <= 0:
        return 0.0
    return min(policy.backoff_max, policy.backoff_initial * (2 ** min(failures - 1, 30)))


def check_failures(book: ReplicaBook, r: Replica, now: float, ctx: Context, plan: Plan) -> None:
    """Fail ``r`` for its first ended shard, or (after the startup grace) for ranks no node reported."""
    if r.failed_at is not None:
        return
    for rank in sorted(r.shards):
        s = r.shards[rank]
        if s.state in (FAILED, GONE, STOPPED):
            what = {FAILED: "failed", GONE: "vanished", STOPPED: "stopped"}[s.state]
            reason = f"shard r{rank} on {s.node_id} {what}" + (f": {s.reason}" if s.reason else "")
            fail(book, r, reason, s.output_tail, now, ctx, plan)
            return
    if r.adopted and not r.complete and not ctx.in_grace:
        missing = [k for k in range(r.nnodes) if r.shards[k].node_id is None]
        fail(book, r, f"rank(s) {', '.join(map(str, missing))} not reported by any node since the "
                      "control plane started", None, now, ctx, plan)


def fail(book: ReplicaBook, r: Replica, reason: str, tail: str | None, now: float, ctx: Context, plan: Plan) -> None:
    r.failed_at, r.failure = now, reason
    hist = book.slot(r.key, r.slot if r.slot is not None else -1)
    hist.failures += 1
    delay = backoff(ctx.restart, hist.failures)
    hist.next_attempt_at = now + delay
    hist.last_failure = {"replica_id": r.replica_id, "reason": reason, "output_tail": tail, "at": now}
    plan.events.append(f"{r.replica_id}: failed ({reason}); attempt {hist.failures + 1} in {delay:g}s")


def stop_failed(book: ReplicaBook, r: Replica, nodes: Mapping[str, NodeView], now: float, plan: Plan) -> None:
    """A failed replica's shards are stopped; it is retired once its slot may be placed again."""
    stop_shards(r, nodes, plan, r.failure or "replica failed")
    if now >= book.slot(r.key, r.slot if r.slot is not None else -1).next_attempt_at:
        retire(r, f"replaced after failure: {r.failure}", now)
