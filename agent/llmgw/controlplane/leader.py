"""Which control plane leads: an etcd lease, a key created under it, and fencing by revision.

Campaign: grant a lease, then a txn that creates the leader key under it
only if the key does not exist (compare ``create_revision == 0``).  The one
whose txn succeeds leads; the key's create revision is its **term**: etcd
revisions only grow, so every later leader has a higher term, and the term
is the epoch the leader stamps on what it tells agents and routers.

Renew: a keep-alive every ``renew_interval``, sent from a thread of its own
(``leasekeeper``) so that a loop held by a long pass does not lose the lease,
but only while the loop has shown progress within ``max_loop_stall``, so that
a wedged one does; each renewal is given until the deadline below
to be answered and asked of the next etcd member when one is silent, while
the members already asked keep their chance (a member whose raft leader died
answers once a new one is elected, within the deadline when
``lease_ttl - 2 * renew_interval`` exceeds etcd's election time).  A leader that cannot renew
steps down *before* its lease can lapse at etcd: ``is_leader`` turns false
``lease_ttl - renew_interval`` seconds after the last keep-alive that was
sent and answered, computed on the monotonic clock at every call, so a
process that was paused (SIGSTOP, a long GC, VM steal) and wakes past that
point is no longer leader before it can act, whatever its loop was doing.
A keep-alive answered with TTL 0 (the lease expired or was revoked) and a
leader key no longer ours end the term at once.  The lease of a term that
ended is revoked by ``resign`` on the way out, so a standby need not wait for
it to lapse.

Threads: the term changes hands only on the event loop (``_lead``,
``_lost``, ``resign``, and ``is_leader``, which steps down).  The renewal
thread moves the deadline forward or records that etcd ended the term, under
``_lock``, and wakes the loop with ``call_soon_threadsafe`` to step down; the
loop reads the deadline under the same lock at every ``is_leader``, so a loop
that comes back from a stall sees the renewals made meanwhile before it acts.

Fenced writes: ``fenced`` wraps operations in a txn that compares the
leader key's mod revision with the one this leader wrote; a deposed leader's
write fails at etcd, whatever its clock believed, and the failure deposes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmgw import compat
from llmgw.controlplane.etcd import AsyncEtcd, EtcdUnavailable, KeyValue, b64
from llmgw.controlplane.leasekeeper import LeaseKeeper
from llmgw.controlplane.store import StoreError

log = logging.getLogger("llmgw.controlplane.leader")

LEADER_KEY = "leader"


@dataclass(frozen=True)
class Term:
    """One leadership as etcd recorded it."""

    epoch: int  # the leader key's create revision: higher for every later leader
    mod_revision: int  # what fenced writes compare
    lease: int


@dataclass(frozen=True)
class LeaderInfo:
    """Who leads, as the leader key says (for standbys' redirects and for people)."""

    name: str
    url: str | None
    epoch: int

    @classmethod
    def from_kv(cls, kv: KeyValue) -> "LeaderInfo":
        try:
            doc = json.loads(kv.value)
            return cls(str(doc.get("name", "?")), doc.get("url"), kv.create_revision)
        except (ValueError, AttributeError):
            return cls("?", None, kv.create_revision)


class Elector:
    """Campaign for, hold and give up the leader key; ``is_leader`` is the only authority."""

    def __init__(self, etcd: AsyncEtcd, prefix: str, name: str, url: str | None, lease_ttl: int,
                 renew_interval: float, clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[bool, int], None] | None = None, max_loop_stall: float = 60.0,
                 renewal_client: Callable[[], Any] | None = None):
        if not 0 < renew_interval * 2 <= lease_ttl:
            raise ValueError(f"renew_interval {renew_interval} must be at most half of lease_ttl {lease_ttl}")
        if not max_loop_stall > renew_interval:
            raise ValueError(f"max_loop_stall {max_loop_stall} must exceed renew_interval {renew_interval}")
        self.etcd = etcd
        self.key = prefix.rstrip("/") + "/" + LEADER_KEY
        self.name, self.url = name, url
        self.ttl, self.renew = int(lease_ttl), float(renew_interval)
        self.clock = clock
        self.on_change = on_change
        self.term: Term | None = None
        self.leader: LeaderInfo | None = None  # the last leader seen (ourselves included)
        self._deadline = float("-inf")  # is_leader is false from then on unless a renewal moves it
        self._lease: int | None = None
        self._given_up: int | None = None  # the lease of a term we stepped down from: revoked on the way out
        self.highest_epoch = 0  # the highest term seen, ours or another's
        self.max_loop_stall = float(max_loop_stall)
        self.loop_progress = clock()  # when the loop last ran the election task (read by the renewal thread)
        # the renewal thread's etcd client: its own, as an httpx client serves one event loop
        self._renewal_client = renewal_client or getattr(etcd, "clone", None) or (lambda: etcd)
        self._lock = threading.Lock()  # term, _deadline and _ended, shared with the renewal thread
        self._ended: str | None = None  # why etcd ended the term, recorded by the renewal thread
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop the term changes hands on

    # ------------------------------------------------------------ authority
    @property
    def is_leader(self) -> bool:
        """Whether this process leads now; on the event loop only (stepping down runs ``on_change``)."""
        with self._lock:
            term, deadline, ended = self.term, self._deadline, self._ended
        if term is None:
            return False
        if ended is not None:
            self._lost(ended)
            return False
        if self.clock() >= deadline:
            self._lost("could not renew the lease in time (lease_ttl - renew_interval since the last renewal)")
            return False
        return True

    def holds_term(self) -> bool:
        """A term not known to have ended (for the renewal thread: it steps nothing down)."""
        with self._lock:
            return self.term is not None and self._ended is None

    @property
    def epoch(self) -> int:
        """This leader's term; 0 while it does not lead."""
        return self.term.epoch if self.is_leader and self.term else 0

    def _lost(self, why: str) -> None:
        with self._lock:
            term = self.term
            if term is None:
                return
            self._given_up = term.lease
            self.term, self._deadline, self._ended = None, float("-inf"), None
        log.warning("stepping down as leader (term %d): %s", term.epoch, why)
        self._lease = None  # a fresh lease for the next campaign: the old one may still hold the key at etcd
        if self.on_change is not None:
            self.on_change(False, 0)

    def _compare_ours(self, term: Term | None = None) -> dict[str, Any]:
        term = term or self.term
        assert term is not None
        return {"key": b64(self.key), "target": "MOD", "mod_revision": str(term.mod_revision)}

    # ------------------------------------------------------------- one step
    async def campaign_once(self) -> bool:
        """One attempt at the leader key; True when this process now leads."""
        sent = self.clock()
        if self._lease is None or await self.etcd.keepalive(self._lease) <= 0:
            sent = self.clock()
            self._lease = await self.etcd.grant(self.ttl)
        value = json.dumps({"name": self.name, "url": self.url}).encode()
        ok, doc = await self.etcd.txn(
            [{"key": b64(self.key), "target": "CREATE", "create_revision": "0"}],
            [self.etcd.put_op(self.key, value, self._lease)],
            [self.etcd.range_op(self.key)])
        if ok:
            rev = int(doc["header"]["revision"])
            return self._lead(Term(rev, rev, self._lease), sent)
        (kv,) = self.etcd.txn_ranges(doc) or [None]
        if kv is not None and kv.lease == self._lease:
            # An earlier campaign of ours created the key but its answer was lost (a member that applied it
            # answered too late, and the next refused the second try): the key is ours. Not leading on it
            # would keep it alive under our lease, and every control plane standing by, for good.
            return self._lead(Term(kv.create_revision, kv.mod_revision, self._lease), sent)
        if kv is not None:
            seen = LeaderInfo.from_kv(kv)
            if seen != self.leader:
                log.info("standing by: %s leads (term %d)%s", seen.name, seen.epoch,
                         f" at {seen.url}" if seen.url else "")
            self.leader = seen
            self.highest_epoch = max(self.highest_epoch, seen.epoch)
        return False

    def _lead(self, term: Term, sent: float) -> bool:
        """Lead as ``term``, whose lease was granted or renewed by a call sent at ``sent``."""
        with self._lock:
            self.term, self._deadline, self._ended = term, sent + self.ttl - self.renew, None
        self.leader = LeaderInfo(self.name, self.url, term.epoch)
        self.highest_epoch = max(self.highest_epoch, term.epoch)
        log.warning("leading the control planes (term %d, lease %ds, renewed every %gs)",
                    term.epoch, self.ttl, self.renew)
        if self.on_change is not None:
            self.on_change(True, term.epoch)
        return True

    async def renew_once(self, etcd: Any = None) -> bool:
        """Renew the lease and check the key is still ours; False (and the term ended) when not.

        Runs on the renewal thread's loop with that thread's ``etcd`` (or on
        the event loop with ``self.etcd``): it only moves the deadline
        forward, or records why the term ended and tells the loop.
        """
        etcd = etcd if etcd is not None else self.etcd
        with self._lock:
            term, deadline = self.term, self._deadline
            if term is None or self._ended is not None:
                return False
        sent = self.clock()
        # An answer after the deadline is no use: the calls may take until then, and no longer.
        ttl = await etcd.keepalive(term.lease, budget=max(0.0, deadline - sent))
        if ttl <= 0:
            return self._end(term, "the lease expired at etcd")
        ok, _ = await etcd.txn([self._compare_ours(term)], [], budget=max(0.0, deadline - self.clock()))
        if not ok:
            return self._end(term, "the leader key is no longer ours")
        with self._lock:
            if self.term is not term or self._ended is not None:  # deposed while we waited
                return False
            self._deadline = max(self._deadline, sent + min(ttl, self.ttl) - self.renew)
            return self.clock() < self._deadline

    def _end(self, term: Term, why: str) -> bool:
        """etcd ended ``term``: ``is_leader`` is false from now, and the loop is told to step down."""
        with self._lock:
            if self.term is not term:
                return False
            self._ended = why
        loop = self._loop
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if loop is None or loop is here:
            self.is_leader  # noqa: B018 (steps down here and now)
        else:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nothing left to tell
                loop.call_soon_threadsafe(lambda: self.is_leader)
        return False

    def fence(self) -> list[dict[str, Any]]:
        """The compares that hold only while this control plane leads (``EtcdBackend``'s fence)."""
        if not self.is_leader:
            raise StoreError("not written: this control plane does not lead")
        return [self._compare_ours()]

    async def fenced(self, ops: list[dict[str, Any]]) -> bool:
        """Apply ``ops`` only while the leader key is still the one we wrote; False (and stepped down) if not."""
        if not self.is_leader:
            return False
        ok, _ = await self.etcd.txn([self._compare_ours()], ops)
        if not ok:
            self._lost("a fenced write found the leader key changed")
        return ok

    async def resign(self) -> None:
        """Give the key up now (a clean stop, or the exit after stepping down): a standby takes over at once.

        After a step-down the old lease may still hold the key at etcd (it
        steps down before the lease can lapse, and a new raft leader extends
        every lease by its election timeout): revoking it spares the standby
        that wait whenever etcd answers again.
        """
        with self._lock:
            term = self.term
            # not _lost(): a resignation is this process's own choice, not news for on_change
            self.term, self._deadline, self._ended = None, float("-inf"), None
        leases = {term.lease if term else self._lease, self._given_up} - {None}
        if term is not None:
            log.warning("giving the lead up (term %d)", term.epoch)
        self._lease, self._given_up = None, None
        for lease in sorted(leases):
            try:
                await self.etcd.revoke(lease)
            except EtcdUnavailable as e:
                log.warning("could not revoke lease %x (it lapses by itself within %ds): %s", lease, self.ttl, e)

    # ----------------------------------------------------------------- loop
    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Campaign while not leading, and mark the loop's progress, until ``stop``; etcd errors are retried.

        The lease is renewed meanwhile by the renewal thread (``LeaseKeeper``),
        for as long as this task keeps running at least every
        ``max_loop_stall``: each pass marks ``loop_progress``.
        """
        stop = stop or asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self.loop_progress = self.clock()
        keeper = LeaseKeeper(self, self._renewal_client)
        keeper.start()
        warned = None
        try:
            while not stop.is_set():
                self.loop_progress = self.clock()
                try:
                    if not self.is_leader:  # also steps down once the deadline has passed
                        await self.campaign_once()
                    warned = None
                except (EtcdUnavailable, KeyError, ValueError) as e:
                    why = str(e)
                    if why != warned:
                        log.warning("etcd: %s", why)
                    warned = why
                wait = self.renew
                with self._lock:
                    deadline = self._deadline if self.term is not None else None
                if deadline is not None:  # wake in time to notice the deadline, not a renew interval later
                    wait = max(0.0, min(wait, deadline - self.clock()))
                try:
                    await compat.wait_for(stop.wait(), timeout=wait)
                except TimeoutError:
                    pass
        finally:
            keeper.stop()
