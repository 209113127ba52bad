"""Which replicas of a scale-to-sleep deployment should sleep or wake now: pure, on the caller's clock.

A deployment with ``autoscale.sleep`` that is at its ``min`` and has had
nothing in flight for ``after`` seconds should be asleep; one with traffic
seen (or a router's wake request) within ``after`` should be awake.  The
rule is level-triggered, like the reconciler: every pass compares what each
replica's rank 0 reports (``Shard.sleeping``, from its agent) with what it
should be, and asks the agent for the difference:

- sleep one replica at a time per deployment (a mistaken sleep costs one
  wake, not the whole deployment's);
- wake every sleeping replica at once (a wake is what a held request waits
  on, and wakes run in parallel on their own GPUs);
- a replica whose agent has not yet said, on its current stream, whether
  it sleeps is neither slept nor woken (after a restart of either side the
  agent asks the engine, ``GET /is_sleeping``, and reports);
- a request already asked for is not asked again until ``resend_after``
  has passed without the report it should bring (a stream that dropped
  carried it away; a repeated ``/sleep`` or ``/wake_up`` is a no-op on the
  engine).

No I/O and no clock here (``tests/unit/test_autoscale_sleep.py`` runs it on a
fake clock); ``ControlPlane.tick`` feeds it the router's load and sends what
it decides down the agent stream (``Sleep``/``Wake`` actions).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from llmgw.catalog import Catalog
from llmgw.controlplane.replicas import READY, Replica, ReplicaBook
from llmgw.protocol import ReplicaState

RESEND_AFTER = 10.0  # s: a sleep or wake asked for and not reported done is asked again


@dataclass(frozen=True)
class Sleep:
    """Ask ``node_id``'s agent to put the engine of ``shard_id`` (a rank 0) to sleep at ``level``."""

    node_id: str
    shard_id: str
    replica_id: str
    level: int

    def message(self) -> dict[str, object]:
        return {"type": "sleep", "shard_id": self.shard_id, "level": self.level}


@dataclass(frozen=True)
class Wake:
    """Ask ``node_id``'s agent to wake the engine of ``shard_id`` (a rank 0)."""

    node_id: str
    shard_id: str
    replica_id: str

    def message(self) -> dict[str, object]:
        return {"type": "wake", "shard_id": self.shard_id}


SleepAction = Sleep | Wake


def serving(r: Replica) -> bool:
    """Ready, kept, and its rank 0 placed: the replicas sleep is about."""
    r0 = r.shards.get(0)
    return (not r.retired and r.state is ReplicaState.READY and r0 is not None and r0.node_id is not None
            and r0.state == READY)


class SleepPlanner:
    """When each scale-to-sleep deployment last had traffic, and what was asked of which replica."""

    def __init__(self, resend_after: float = RESEND_AFTER) -> None:
        self.resend_after = resend_after
        self.busy_at: dict[str, float] = {}  # deployment key -> last time something was in flight for it
        self.asked: dict[str, tuple[str, float]] = {}  # replica id -> ("sleep" | "wake", when)

    def observe(self, key: str, now: float, in_flight: float) -> None:
        """The deployment's requests in flight now; a first sighting starts its idle clock."""
        if in_flight > 0 or key not in self.busy_at:
            self.busy_at[key] = now

    def wake_requested(self, keys: Iterable[str], now: float) -> None:
        """A router holds a request for these deployments: traffic, as good as one in flight."""
        for key in keys:
            self.busy_at[key] = now

    def should_sleep(self, key: str, after: float, now: float) -> bool:
        busy = self.busy_at.get(key)
        return busy is not None and now - busy >= after

    def decide(self, catalog: Catalog, book: ReplicaBook, counts: Mapping[str, int], now: float
               ) -> list[SleepAction]:
        """What to ask of which agent this pass; ``counts``: the autoscaler's counts by deployment key."""
        actions: list[SleepAction] = []
        keys = set()
        replicas = sorted(book.replicas.values(), key=lambda r: r.replica_id)
        for dep in catalog.deployments:
            policy = dep.autoscale
            if policy is None or policy.sleep is None:
                continue
            keys.add(dep.key)
            # a replica whose agent has not said on its current stream whether it sleeps (just restarted,
            # or this control plane just started) is left alone until it does: no sleep or wake on a guess
            mine = [r for r in replicas if r.key == dep.key and serving(r) and r.shards[0].sleep_known]
            at_min = counts.get(dep.key, policy.min) <= policy.min
            asleep = at_min and self.should_sleep(dep.key, policy.sleep.after, now)
            pending_sleep = False
            for r in mine:
                r0 = r.shards[0]
                want = "sleep" if asleep else "wake"
                done = r0.sleeping == asleep
                asked = self.asked.get(r.replica_id)
                if done:
                    self.asked.pop(r.replica_id, None)
                    continue
                fresh = asked is not None and asked[0] == want and now - asked[1] < self.resend_after
                if want == "sleep":
                    pending_sleep = pending_sleep or fresh
                if fresh:
                    continue
                if want == "wake":
                    actions.append(Wake(str(r0.node_id), r0.shard_id, r.replica_id))
                    self.asked[r.replica_id] = (want, now)
            if asleep and not pending_sleep:
                for r in mine:
                    # a replica just Ready gets the whole idle time too: it may have come for a request. No
                    # ready_since yet is the newest of all: its report came since the last reconcile, which
                    # notes it after this runs in the same pass
                    fresh_ready = r.ready_since is None or now - r.ready_since < policy.sleep.after
                    if not r.shards[0].sleeping and not fresh_ready:
                        r0 = r.shards[0]
                        actions.append(Sleep(str(r0.node_id), r0.shard_id, r.replica_id, policy.sleep.level))
                        self.asked[r.replica_id] = ("sleep", now)
                        break
        for key in set(self.busy_at) - keys:
            del self.busy_at[key]
        for rid in [rid for rid in self.asked if rid not in book.replicas]:
            del self.asked[rid]
        return actions

    def sleeping_keys(self, catalog: Catalog, model: str) -> list[str]:
        """The scale-to-sleep deployments serving ``model`` (a served name): what a wake request wakes."""
        return [d.key for d in catalog.serving(model) if d.autoscale is not None and d.autoscale.sleep is not None]
