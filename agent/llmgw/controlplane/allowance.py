"""The global books of per-key limits: slices of each key's allowance leased to router workers.

Every router worker enforcing a key's whole limit on its own admits up to
routers x workers times that limit.  Instead each worker leases *slices*
of a limited key's allowance from here, one *pool* per key (or key and
model), dimension and window, spends them locally with no round trip per
request, and returns what it did not spend.  Pure bookkeeping on a clock
the caller passes in; ``allowance_api.py`` is the HTTP route.

The rule that keeps the sum granted under the limit:

* **A grant counts in full until it is proven spent earlier.**  A slice of
  ``g`` granted at ``t`` with lease time ``T`` counts ``g`` until
  ``t + T + span``: every unit of it is spent by ``t + T`` (the worker stops
  spending at its own expiry, which comes before ours: it started counting
  when it sent the ask), so it has left any window by then.  ``granted +
  still counted <= limit`` at every instant, so no window ever holds more
  than the limit.
* **What is returned comes back at once.**  A worker returns its lease
  (at expiry, or when it asks again) with what it did not spend and how
  long ago it spent last (``idle``, on its own clock: no clock is shared);
  the unspent part is freed now, the spent part counts until ``now - idle +
  span``, the end of the window of its last spend.
* **A dead worker's slice frees itself** at ``t + T + span``: nothing
  waits for it to come back.
* **Slice size adapts**: ``max(need, free // (2 * holders))``, never more
  than ``free``, where ``holders`` are the workers holding a live lease on
  the pool (counting the asker).  Far from the limit a worker gets a share
  that lasts it many requests; near it, slices shrink to exactly what the
  asking request needs, so the last units of a window are never stranded
  in a worker that does not use them.  What other workers still hold when
  a pool is empty is bounded by half of what was free at their last grant,
  and comes back at their lease's end (``Retry-After`` says so).
* **A new book grants nothing for one lease time** (after the control
  plane starts, and after it takes the lead with ``ha``): leases granted
  by a previous process or leader end within ``T``, so no slice of the old
  books is alive once grants start.  What the old books counted as spent is
  not known here: in the window of a restart or failover a key may be
  admitted up to its limit once more (docs/router.md).

**Concurrent requests** (``concurrent_requests``) are a pool with no
window: a slot is not spent but *held* while a request runs, and given
back when it ends.  A worker holds one lease per such pool, ``amount``
slots counted until the lease ends (``t + T``, nothing after: a slot
leaves no trace in a window).  Each exchange that asks for the pool
*renews* the worker's lease: the worker says how many slots it keeps
(``held``, its requests running when it sent the ask, never more than
its live lease had) and how many more it needs; the old lease is replaced
by one of ``held`` plus a slice sized as for the other dimensions.  A
worker renews while it has requests running, and gives its spare slots
back with the renewal or the return.  A dead worker's slots free
themselves when its lease ends: they are unavailable for at most ``T``.
When the books do not know the worker's lease (a restart, a lease that
lapsed) ``held`` is granted only from what is free, so the slots counted
never pass the limit; the worker admits nothing until its running
requests fit what it holds.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field

__all__ = ["AllowanceBook", "Ask", "Return", "Grant", "Denial", "PoolKey", "DIMENSIONS", "CONCURRENT"]

CONCURRENT = "concurrent_requests"  # held while a request runs, not spent in a window
DIMENSIONS = ("requests", "input_tokens", "output_tokens", "tokens", "tokens_per_day", CONCURRENT)
CONCURRENT_RETRY = 1.0  # a slot frees when some request ends: no window says when; a second is a fair retry
MAX_LEASES_PER_HOLDER = 4096  # a worker holds one lease per pool; more is a runaway


PoolKey = tuple  # (key name, scope: "" or a model name, dimension)


@dataclass(frozen=True)
class Ask:
    key: str
    scope: str
    dimension: str
    limit: int
    span: float  # the window, seconds
    need: int  # at least this much, or nothing
    held: int = 0  # concurrent_requests: slots of the worker's lease that it keeps (requests running)

    @property
    def pool(self) -> PoolKey:
        return (self.key, self.scope, self.dimension)


@dataclass(frozen=True)
class Return:
    lease: str
    unused: int  # not spent; freed now
    idle: float  # seconds since the lease's last spend (ignored when nothing was spent)


@dataclass(frozen=True)
class Grant:
    pool: PoolKey
    lease: str
    amount: int
    ttl: float
    remaining: int  # free in the pool after this grant (OpenAI's x-ratelimit-remaining-*)
    reset: float  # seconds until everything counted now has left the window
    retry_after: float | None = None  # concurrent_requests: the slots kept, but ``need`` more did not fit


@dataclass(frozen=True)
class Denial:
    pool: PoolKey
    retry_after: float  # inf: ``need`` is larger than the limit and can never fit
    limit: int
    reset: float


@dataclass
class _Lease:
    pool: PoolKey
    holder: tuple[str, str]  # (router certificate name, worker instance)
    amount: int
    expires: float
    entry: list  # [end, amount] in the pool


@dataclass
class _Pool:
    limit: int
    span: float
    entries: list = field(default_factory=list)  # [end, amount]: counts until ``end``
    leases: set = field(default_factory=set)  # live lease ids

    def counted(self, now: float) -> int:
        if self.entries and any(e[0] <= now for e in self.entries):
            self.entries = [e for e in self.entries if e[0] > now and e[1] > 0]
        return sum(e[1] for e in self.entries)

    def wait(self, need: int, now: float) -> float:
        """Seconds until ``need`` fits, if nothing more is granted and nothing returned."""
        excess = self.counted(now) + need - self.limit
        if excess <= 0:
            return 0.0
        for end, amount in sorted(self.entries):
            excess -= amount
            if excess <= 0:
                return max(0.0, end - now)
        return self.span  # pragma: no cover - the entries hold what is counted

    def reset(self, now: float) -> float:
        return max((e[0] for e in self.entries), default=now) - now


class AllowanceBook:
    """Every pool and live lease; ``lease_seconds`` is the ``T`` of every grant."""

    def __init__(self, lease_seconds: float, now: float) -> None:
        self.lease_seconds = lease_seconds
        self.pools: dict[PoolKey, _Pool] = {}
        self.leases: dict[str, _Lease] = {}
        self.hold_until = now + lease_seconds  # see "A new book grants nothing"

    def restart(self, now: float) -> None:
        """Forget every pool and lease (a new leader's books) and grant nothing for one lease time."""
        self.pools.clear()
        self.leases.clear()
        self.hold_until = now + self.lease_seconds

    def holding(self, now: float) -> float:
        """Seconds left before this book grants (0: it does)."""
        return max(0.0, self.hold_until - now)

    def settle(self, holder: tuple[str, str], returns: list[Return], now: float) -> None:
        """Take leases back; a lease of another holder, or one already back or expired, is ignored."""
        self._expire(now)
        for r in returns:
            lease = self.leases.get(r.lease)
            if lease is None or lease.holder != holder:
                continue
            self._drop(r.lease, lease)
            unused = min(max(0, r.unused), lease.amount)
            entry = lease.entry
            entry[1] -= unused
            if entry[1] > 0 and lease.pool[2] != CONCURRENT:  # slots still held count until the lease ends
                pool = self.pools.get(lease.pool)
                span = pool.span if pool is not None else 0.0
                entry[0] = min(entry[0], now - min(max(0.0, r.idle), self.lease_seconds) + span)

    def grant(self, holder: tuple[str, str], asks: list[Ask], now: float) -> list[Grant | Denial]:
        """One answer per ask, in order: a slice of at least ``need``, or a denial with its wait."""
        self._expire(now)
        out: list[Grant | Denial] = []
        mine = sum(1 for lease in self.leases.values() if lease.holder == holder)
        for a in asks:
            pool = self.pools.get(a.pool)
            if pool is None:
                pool = self.pools[a.pool] = _Pool(a.limit, a.span)
            pool.limit, pool.span = a.limit, a.span  # a reload changed it: the new limit holds from now
            if a.dimension == CONCURRENT:
                out.append(self._slots(holder, a, pool, now))
                continue
            if a.need > a.limit:
                out.append(Denial(a.pool, math.inf, a.limit, pool.reset(now)))
                continue
            free = pool.limit - pool.counted(now)
            if a.need > free or mine >= MAX_LEASES_PER_HOLDER:
                wait = pool.wait(a.need, now)
                held = [e for i in pool.leases if (e := self.leases[i].expires) > now]
                if held:  # what other workers hold unspent comes back when their lease ends
                    wait = min(wait, max(0.0, min(held) - now))
                out.append(Denial(a.pool, max(wait, 0.001), pool.limit, pool.reset(now)))
                continue
            holders = len({self.leases[i].holder for i in pool.leases if self.leases[i].expires > now} | {holder})
            amount = min(free, max(a.need, free // (2 * holders)))
            lease_id = secrets.token_hex(8)
            entry = [now + self.lease_seconds + pool.span, amount]
            pool.entries.append(entry)
            pool.leases.add(lease_id)
            self.leases[lease_id] = _Lease(a.pool, holder, amount, now + self.lease_seconds, entry)
            mine += 1
            out.append(Grant(a.pool, lease_id, amount, self.lease_seconds, free - amount, pool.reset(now)))
        return out

    def _slots(self, holder: tuple[str, str], a: Ask, pool: _Pool, now: float) -> Grant | Denial:
        """Renew ``holder``'s lease of concurrency slots: keep ``held`` of it, and add ``need`` or more."""
        pool.span = 0.0  # a slot counts while its lease lasts, never in a window
        if a.need > a.limit:
            return Denial(a.pool, math.inf, a.limit, 0.0)
        keep = max(0, a.held)
        old_id = next((i for i in pool.leases
                       if self.leases[i].holder == holder and self.leases[i].expires > now), None)
        if old_id is not None:  # replaced, not added to: the slots kept move to the new lease
            old = self.leases[old_id]
            keep = min(keep, old.entry[1])
            old.entry[1] = 0
            self._drop(old_id, old)
        free = pool.limit - pool.counted(now)
        keep = min(keep, max(0, free))  # unknown to these books (a restart): only from what is free
        free -= keep
        extra = 0
        short = a.need > free
        if a.need and not short:
            holders = len({self.leases[i].holder for i in pool.leases if self.leases[i].expires > now} | {holder})
            extra = min(free, max(a.need, free // (2 * holders)))
        amount = keep + extra
        retry = CONCURRENT_RETRY if short else None
        if amount == 0:
            return Denial(a.pool, retry or 0.001, pool.limit, 0.0)
        lease_id = secrets.token_hex(8)
        entry = [now + self.lease_seconds, amount]
        pool.entries.append(entry)
        pool.leases.add(lease_id)
        self.leases[lease_id] = _Lease(a.pool, holder, amount, now + self.lease_seconds, entry)
        return Grant(a.pool, lease_id, amount, self.lease_seconds, free - extra, self.lease_seconds, retry)

    def outstanding(self, pool: PoolKey, now: float) -> int:
        """What the pool counts now (granted and not returned, or spent and still in the window)."""
        p = self.pools.get(pool)
        return 0 if p is None else p.counted(now)

    def _drop(self, lease_id: str, lease: _Lease) -> None:
        del self.leases[lease_id]
        pool = self.pools.get(lease.pool)
        if pool is not None:
            pool.leases.discard(lease_id)

    def _expire(self, now: float) -> None:
        """Leases one lease time past their end: no longer returnable (their entries count until they end).

        A lease past its end is spent no more but may still be on its way back
        (a worker returns it at its own expiry, which the network delays).
        """
        for lease_id in [i for i, lease in self.leases.items() if lease.expires + self.lease_seconds <= now]:
            self._drop(lease_id, self.leases[lease_id])
        for key in [k for k, p in self.pools.items() if not p.leases and not p.counted(now)]:
            del self.pools[key]
