"""The catalog's changes rolled out: replicas out of the catalog retired, changed ones replaced one at a time.

An adopted shard is kept when its model and profile are in the catalog
exactly as it runs them, and stopped when they are not: nothing will route
to it and it holds GPUs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmgw.catalog import Catalog
from llmgw.controlplane.reconcile.plan import Plan
from llmgw.controlplane.reconcile.stopping import retire
from llmgw.controlplane.replicas import Replica, ReplicaBook, ReplicaState, spec_matcher


def retire_uncatalogued(book: ReplicaBook, catalog: Catalog, now: float, plan: Plan) -> None:
    declared = {(d.model, d.profile) for d in catalog.deployments}
    outdated: dict[str, list[Replica]] = {}
    matchers: dict[tuple[str, str], Callable[[dict[str, Any]], bool]] = {}
    for r in book.live():
        if (r.model, r.profile) not in declared or r.model not in catalog.models or r.profile not in catalog.profiles:
            retire(r, f"{r.model}/{r.profile} is not in the catalog", now)
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
                retire(r, "its model/profile definition differs from the catalog's", now)
                plan.events.append(f"{r.replica_id}: replacing, its spec differs from the catalog's {key}")
        serving = [r for r in olds if not r.retired]
        others = [r for r in book.replicas.values() if r.key == key and r not in serving]
        if not serving or any(r.retired or r.state is not ReplicaState.READY for r in others):
            continue
        victim = min(serving, key=lambda r: (r.slot if r.slot is not None else 1 << 30, r.replica_id))
        retire(victim, "its model/profile definition differs from the catalog's", now)
        plan.events.append(f"{victim.replica_id}: replacing, its spec differs from the catalog's {key}")
