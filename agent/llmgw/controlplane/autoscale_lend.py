"""Lending a sleeping deployment's GPUs to one that cannot be placed without them (``autoscale.sleep.lend``).

An idle deployment put to sleep still holds its GPUs, so that a request
wakes it in about a second.  On a full fleet that can keep another model's
replica unplaced for as long as nobody asks for the sleeping one.  With
``sleep.lend`` such a deployment lends instead: when every replica of it
sleeps and another deployment of the same priority or higher has a slot
that does not fit now but would fit on the GPUs it holds, its count is
taken to zero (its replicas drain, which for a sleeping engine is at once,
and stop) and the borrower is placed on the GPUs when they are released.

The lender comes back from zero (``autoscale_zero``): its served name is
published as one that scales from zero, a request for it is held by the
routers, and the wake they ask for ends the loan, so its count is its
scaler's again and a replica is placed wherever GPUs are free, a whole
start rather than a wake (if the borrower still holds the only GPUs, the
held request gets its 503 at the hold deadline and the lender waits,
unplaced, as any deployment does; the fleet GPU budget decides between
priorities where one is set).

``Lending.lend`` asks placement itself, on the fleet as it is and on the fleet
with the lender's GPUs released, so a loan is made only where it places the
borrower (the right node, enough GPUs on one node, its fabric), never on a
GPU count alone.  At most one loan a pass, and none for a borrower whose
last lender is still stopping: the GPUs it freed have not been counted yet.
The same waiting slots beside the same sleeping lenders are looked at again
only ``RETRY_AFTER`` (10 s) later when no loan placed them (each look walks
the fleet's GPUs); a lender that falls asleep is looked at on the next pass.
Loans live in memory: a control plane that restarts forgets them, and a
lender then starts again where GPUs are free.

No I/O and no clock (``tests/unit/test_autoscale_lend.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from llmgw.catalog import Catalog, Deployment
from llmgw.controlplane.capacity import FleetCapacity
from llmgw.controlplane.reconcile.plan import NodeView
from llmgw.controlplane.reconcile.placement import place_one, placement_request
from llmgw.controlplane.autoscale_sleep import serving
from llmgw.controlplane.replicas import Replica, ReplicaBook


@dataclass(frozen=True)
class Loan:
    lender: str  # the deployment key whose GPUs were lent (its count is 0 while the loan stands)
    borrower: str  # the deployment key that could not be placed without them
    since: float


def _priority(dep: Deployment) -> int:
    return dep.autoscale.priority if dep.autoscale is not None else 0


RETRY_AFTER = 10.0  # s before the same waiting slots are looked at again when no loan placed them


class Lending:
    def __init__(self, retry_after: float = RETRY_AFTER) -> None:
        self.loans: dict[str, Loan] = {}  # by lender key
        self.retry_after = retry_after
        # the waiting slots and sleeping lenders of the last look that made no loan, and when: a slot that
        # waits for good (a model too big for any node) must not cost a walk of the fleet on every pass
        self._looked: tuple[tuple[frozenset[tuple[str, int]], frozenset[str]], float] | None = None

    def counts(self, counts: Mapping[str, int]) -> dict[str, int]:
        """``counts`` with every lender's at zero."""
        return {k: (0 if k in self.loans else n) for k, n in counts.items()}

    def end(self, key: str) -> Loan | None:
        """The lender ``key`` is asked for again: its count is its scaler's from now on."""
        return self.loans.pop(key, None)

    def forget(self, catalog: Catalog) -> None:
        """Loans of lenders the catalog no longer has, or no longer lets lend."""
        keep = {d.key for d in catalog.deployments if d.autoscale is not None and d.autoscale.lends}
        for key in [k for k in self.loans if k not in keep]:
            del self.loans[key]

    def lend(self, catalog: Catalog, book: ReplicaBook, nodes: Mapping[str, NodeView],
             unplaced: Mapping[tuple[str, int], str], now: float, memory_headroom: float,
             weight_sizes: Mapping[str, int] | None = None) -> Loan | None:
        """A new loan when a deployment waiting for a slot would be placed on a sleeping lender's GPUs."""
        lenders = [d for d in catalog.deployments
                   if d.autoscale is not None and d.autoscale.lends and d.key not in self.loans]
        if not lenders or not unplaced:
            return None
        live: dict[str, list[Replica]] = {}
        for r in book.live():
            live.setdefault(r.key, []).append(r)
        # every replica asleep: an idle lender (one awake, or still starting, is serving or about to)
        asleep = {d.key: live[d.key] for d in lenders if live.get(d.key) and all(serving(r) and r.shards[0].sleeping for r in live[d.key])}
        if not asleep:
            return None
        look = (frozenset(unplaced), frozenset(asleep))
        if self._looked is not None and self._looked[0] == look and now - self._looked[1] < self.retry_after:
            return None
        self._looked = (look, now)
        stopping = {loan.borrower for loan in self.loans.values() if live.get(loan.lender)}
        waiting = {key for key, _slot in unplaced}
        claimed = {n: set(book.claimed(n)) for n in nodes}
        fleet = FleetCapacity.of(claimed, nodes)
        for dep in catalog.deployments:
            if dep.key not in waiting or dep.key in stopping:
                continue
            request = placement_request(catalog, dep, memory_headroom, weight_sizes)
            if place_one(fleet, book, request).placement is not None:
                continue  # it fits as things are: it waits for something else (grace, backoff, sizing)
            for lender in sorted(lenders, key=lambda d: (_priority(d), d.key)):
                if lender.key == dep.key or lender.key not in asleep or _priority(lender) > _priority(dep):
                    continue
                freed = dict(claimed)  # a new set only on the lender's nodes: the rest are read, not changed
                for r in asleep[lender.key]:
                    for s in r.shards.values():
                        if s.node_id in freed:
                            freed[s.node_id] = freed[s.node_id] - set(s.gpu_indices)
                if place_one(FleetCapacity.of(freed, nodes), book, request).placement is not None:
                    loan = self.loans[lender.key] = Loan(lender.key, dep.key, now)
                    self._looked = None
                    return loan
        return None
