"""The leader's lease, renewed from a thread of its own rather than on the control plane's event loop.

Why: a renewal on the event loop waits behind whatever holds the loop.  A
long CPU-bound pass, a cold start of thousands of agents or a loaded host
held the loop past ``lease_ttl - renew_interval`` and deposed a leader that
was alive and reached etcd (a 9.1 s stall in a 5,000-node cold start).  The
keeper runs its own small event loop in a daemon thread, with an etcd client
of its own (``AsyncEtcd.clone``: the same hedged keep-alive across members),
and renews every ``renew_interval`` whatever the main loop is doing.

A *wedged* loop must not hold the lead for ever: the elector's loop marks its
progress at least every ``renew_interval`` (``Elector.run``), and the keeper
renews only while that mark is at most ``max_loop_stall`` old.  Past it the
renewals stop, the leader's deadline passes, its lease lapses at etcd and a
standby takes over; when the loop comes back it finds it no longer leads and
exits.  Nothing else changes hands here: the keeper only moves the deadline
forward or records that etcd ended the term (``Elector.renew_once``); the
loop learns of it through ``call_soon_threadsafe`` and steps down there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from llmgw.controlplane.etcd import EtcdUnavailable

if TYPE_CHECKING:
    from llmgw.controlplane.leader import Elector

log = logging.getLogger("llmgw.controlplane.leader")


def renewal_allowed(now: float, progress: float, max_loop_stall: float) -> bool:
    """Renew only while the loop showed progress within ``max_loop_stall``: a wedged loop loses the lead."""
    return now - progress <= max_loop_stall


class LeaseKeeper:
    """A daemon thread renewing ``elector``'s lease, with its own loop and the etcd client ``client()`` makes."""

    def __init__(self, elector: "Elector", client: Callable[[], Any]):
        self.elector = elector
        self._client = client
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._held_back = False  # logged once per wedge
        self._warned: str | None = None  # the last etcd error logged, once until it changes

    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="lease renewal", daemon=True)
        self._thread.start()
        self._ready.wait(5)

    def stop(self, timeout: float = 1.0) -> None:
        """Stop renewing; an in-flight renewal is cancelled.  Waits ``timeout`` at most for the thread."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):  # its loop already ended
                loop.call_soon_threadsafe(stop.set)
        if self._thread is not None:
            self._thread.join(timeout)

    def _main(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self._ready.set()
        etcd = self._client()
        stopping = asyncio.ensure_future(self._stop.wait())
        try:
            while not self._stop.is_set():
                renewal = asyncio.ensure_future(self.renew(etcd))
                await asyncio.wait({renewal, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if not renewal.done():  # stopping: a renewal in flight is of no use now
                    renewal.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await renewal
                    break
                if (failed := renewal.exception()) is not None:  # a fault of ours: logged, and the next one tried
                    log.error("lease renewal failed: %r", failed)
                await asyncio.wait({stopping}, timeout=self.elector.renew)
        finally:
            stopping.cancel()
            close = getattr(etcd, "aclose", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    await close()

    async def renew(self, etcd: Any) -> None:
        """One renewal of the current term, unless there is none or the loop is wedged."""
        e = self.elector
        if not e.holds_term():
            self._held_back = False
            return
        now, progress = e.clock(), e.loop_progress
        if not renewal_allowed(now, progress, e.max_loop_stall):
            stalled = now - progress
            if not self._held_back:
                log.error("the event loop has shown no progress for %.1fs (ha.max_loop_stall %gs): no longer "
                          "renewing the lease, so that a standby takes over", stalled, e.max_loop_stall)
            self._held_back = True
            return
        self._held_back = False
        try:
            await e.renew_once(etcd)
            self._warned = None
        except (EtcdUnavailable, KeyError, ValueError) as ex:
            why = str(ex)
            if why != self._warned:
                log.warning("etcd: %s; still leading until the lease's deadline", why)
            self._warned = why
