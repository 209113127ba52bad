"""The control plane's autoscaler: signals in, a replica count per autoscaled deployment out.

The rule is ``autoscale.Scaler`` (pure, one per deployment); this keeps the
scalers across passes and catalog reloads and turns what the in-process
router sees (requests in flight per replica) into one total per deployment.
Still no I/O and no clock: ``ControlPlane.tick`` passes both in, and the
counts go to the reconciler in its ``Context`` (``reconcile/replicacount.py``).

A control plane that has just started knows neither the signal nor what
runs, so during its startup grace the count is the larger of the declared
start and the replicas already reported (clamped): adopted replicas are not
drained only because nothing was measured yet.  The first scaler starts
from that count when the grace ends.

A deployment on an engine signal (``queue_depth``, ``kv_cache_use``) is fed
its ``enginesignals.Sample`` instead, whatever the routers say; a partial
sample (a Ready replica without a fresh value) is no sample, and its count
holds.  The last sample of each is kept for ``ctl explain`` and the metrics.

A deployment that scales to zero (``min: 0``) has, at zero, no replica a
router's load could be counted on: the routers that hold requests for it
say how many with each wake (``note_held``), and for ``HELD_FRESH`` seconds
that count is the deployment's signal wherever the routers' own total is
lower. It starts the first replica (the rule scales up from zero on any
demand, reversal or not) and keeps the count off zero while requests wait.

Each scaler is told its deployment's lead time, how long its last replicas
took from placement to Ready as this control plane saw them
(``autoscale_lead``), so a rising signal is followed that far ahead.

With a fleet GPU budget (``Catalog.autoscale_budget``) the scalers' counts
are what each deployment's demand asks for; the counts returned are what
``autoscale_budget.Budget`` grants them from the pool by priority, and the
reconciler places those.  Not during the grace: adopted replicas stay until
something is measured, as above.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from llmgw.catalog import Catalog
from llmgw.controlplane.autoscale import Decision, Scaler
from llmgw.controlplane.autoscale_budget import Budget, Grant, claims_of
from llmgw.controlplane.autoscale_lead import LeadTimes
from llmgw.controlplane.enginesignals import Sample
from llmgw.controlplane.replicas import ReplicaBook, ReplicaState


def totals_by_deployment(outstanding: Mapping[str, int], book: ReplicaBook) -> dict[str, float]:
    """Requests in flight per deployment key, from the router's count per replica id.

    A draining replica's requests count too: they are demand the remaining
    replicas must take once it is gone.  A replica the book does not know is
    left out (the router's table lags the book by at most one update).
    """
    totals: dict[str, float] = {}
    for rid, n in outstanding.items():
        r = book.replicas.get(rid)
        if r is not None:
            totals[r.key] = totals.get(r.key, 0.0) + n
    return totals


HELD_FRESH = 2.5  # s a router's held count stands for: it asks again each second while it holds


class Autoscaler:
    def __init__(self) -> None:
        self.scalers: dict[str, Scaler] = {}
        # requests held for a deployment at zero, by (deployment key, router): (when told, how many)
        self.held: dict[tuple[str, str], tuple[float, int]] = {}
        self.budget = Budget()
        self.grants: dict[str, Grant] = {}  # the last pass's, by deployment key (only with a budget)
        self.leads = LeadTimes()
        self.engine: dict[str, Sample] = {}  # the last pass's engine-signal samples, by deployment key

    def counts(self, catalog: Catalog, book: ReplicaBook, now: float, totals: Mapping[str, float] | None,
               in_grace: bool = False, engine: Mapping[str, Sample] | None = None) -> dict[str, int]:
        """The replica count of every autoscaled deployment, having fed it ``totals`` (the routers' requests
        in flight) or, for a deployment on an engine signal, its sample in ``engine``.

        ``totals`` None: no router signal this pass (no router, one silent); those counts stay. A
        deployment on an engine signal without a whole sample keeps its count too.
        """
        self.engine = dict(engine or {})
        out: dict[str, int] = {}
        keys = {dep.key for dep in catalog.deployments if dep.autoscale is not None}
        self.leads.note(book, keys)
        self.leads.forget(keys)
        # serving now, by deployment, for those whose scale-up is held to max_scale_up_rate times it: a walk
        # over the whole book, so only when some policy sets a rate
        rated = {dep.key for dep in catalog.deployments
                 if dep.autoscale is not None and dep.autoscale.max_scale_up_rate}
        ready = Counter(k for r in book.live() if (k := r.key) in rated and r.state is ReplicaState.READY) \
            if rated else Counter()
        for dep in catalog.deployments:
            policy = dep.autoscale
            if policy is None:
                continue
            scaler = self.scalers.get(dep.key)
            if in_grace and scaler is None:
                live = sum(1 for r in book.live() if r.key == dep.key)
                out[dep.key] = policy.clamp(max(dep.replicas, live))
                continue
            if scaler is None or scaler.policy != policy:
                # a new deployment starts from its declared count (or what runs); a changed
                # policy keeps the count reached and starts measuring afresh
                live = sum(1 for r in book.live() if r.key == dep.key)
                start = scaler.desired if scaler is not None else max(dep.replicas, live)
                scaler = self.scalers[dep.key] = Scaler(policy, start, now)
            if policy.signal != "outstanding":
                sample = self.engine.get(dep.key)
                value = None if sample is None or sample.signal != policy.signal else sample.total
            else:
                value = None if totals is None else totals.get(dep.key, 0.0)
                held = self._held(dep.key, now) if self.held else 0
                if held and (value is None or held > value):
                    value = float(held)
            if value is not None:
                scaler.observe(now, value)
                scaler.decide(now, self.leads.lead(dep.key), ready.get(dep.key, 0) if dep.key in rated else None)
            out[dep.key] = scaler.desired
        for key in set(self.scalers) - keys:
            del self.scalers[key]
        if catalog.autoscale_budget is None or in_grace:
            self.grants = {}
            return out
        gpus = {name: p.gpus_total for name, p in catalog.profiles.items()}
        self.grants = self.budget.grant(claims_of(catalog.deployments, out, gpus), catalog.autoscale_budget, now)
        return {key: (self.grants[key].granted if key in self.grants else n) for key, n in out.items()}

    def note_held(self, key: str, router: str, held: int, now: float) -> None:
        """A router holds ``held`` requests for ``key``, a deployment at zero replicas (its wake said so)."""
        self.held[(key, router)] = (now, max(0, held))

    def _held(self, key: str, now: float) -> int:
        """Requests the routers said they hold for ``key`` within ``HELD_FRESH``; older word is forgotten."""
        total = 0
        for k, (at, n) in list(self.held.items()):
            if now - at > HELD_FRESH:
                del self.held[k]
            elif k[0] == key:
                total += n
        return total

    def decision(self, key: str) -> Decision | None:
        s = self.scalers.get(key)
        return s.decision if s is not None else None

    def sample(self, key: str) -> Sample | None:
        """The deployment's last engine-signal sample (None: it scales on the routers' load)."""
        return self.engine.get(key)

    def grant(self, key: str) -> Grant | None:
        """What the fleet GPU budget granted the deployment last pass (None: no budget)."""
        return self.grants.get(key)
