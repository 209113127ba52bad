"""The leader's lease renewed from its own thread: a held loop keeps the lead, a wedged one loses it.

The event loop is held the way a long CPU-bound pass holds it (a busy loop
on the loop's thread, holding the GIL but for the interpreter's switches);
etcd is a fake answering at once, so what is tested is the rule, not etcd.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from llmgw.config import ConfigInvalid
from llmgw.controlplane.etcd import _Calls
from llmgw.controlplane.leader import Elector
from llmgw.controlplane.leasekeeper import renewal_allowed
from llmgw.settings import parse_server_settings
from tests.support.polling import until_async
from tests.unit.cp_state_fakes import settings

TTL, RENEW = 1, 0.1


class FakeEtcd(_Calls):
    """Grants lease 7; every keep-alive answers ``ttl`` (0: the lease expired); the key is ours."""

    def __init__(self, ttl: int = TTL) -> None:
        self.ttl = ttl
        self.taken = False  # another control plane holds the key: campaigns fail
        self.keepalives: list[tuple[float, str]] = []  # when, and on which thread

    def clone(self) -> "FakeEtcd":
        return self

    async def grant(self, ttl: int) -> int:
        return 7

    async def keepalive(self, lease: int, budget: float | None = None) -> int:
        self.keepalives.append((time.monotonic(), threading.current_thread().name))
        return self.ttl

    async def txn(self, compare, success, failure=None, budget=None):
        if self.taken and compare[0]["target"] == "CREATE":
            return False, {"header": {"revision": "9"}}
        return True, {"header": {"revision": "5"}}

    async def revoke(self, lease: int) -> None:
        pass


def hold_loop(until, cap: float = 30.0) -> None:
    """Hold the calling thread (the event loop's) busy until ``until()``; fail past ``cap`` seconds."""
    end = time.monotonic() + cap
    while not until():
        assert time.monotonic() < end, "the condition never held"
        sum(range(1000))  # CPU-bound, as a long pass is: the GIL is held but for the switch interval


async def leading(e: Elector, changes: list) -> tuple[asyncio.Event, asyncio.Task]:
    e.on_change = lambda leader, epoch: changes.append((leader, epoch, threading.current_thread().name))
    stop = asyncio.Event()
    task = asyncio.create_task(e.run(stop))
    await until_async(lambda: e.is_leader, "the elector to lead", timeout=10)
    return stop, task


def test_the_rule_renews_only_while_the_loop_showed_progress_within_the_bound():
    assert renewal_allowed(now=100.0, progress=95.0, max_loop_stall=60.0)
    assert renewal_allowed(now=160.0, progress=100.0, max_loop_stall=60.0)
    assert not renewal_allowed(now=160.1, progress=100.0, max_loop_stall=60.0)


def test_a_loop_held_longer_than_the_lease_keeps_the_lead():
    """Renewed on the loop, the lease would lapse while the loop is held; renewed apart, it does not."""
    etcd, changes = FakeEtcd(), []

    async def scenario() -> None:
        e = Elector(etcd, "/t", "a", None, TTL, RENEW)  # type: ignore[arg-type]
        stop, task = await leading(e, changes)
        held = time.monotonic()
        hold_loop(lambda: time.monotonic() - held > TTL + 2 * RENEW)  # longer than the lease lives
        renewed = [t for t, _ in etcd.keepalives if t > held]
        assert e.is_leader, "a held loop is not a wedged one: the lead is kept"
        assert renewed, "renewed while the loop was held"
        stop.set()
        await task

    asyncio.run(scenario())
    assert [c[:2] for c in changes] == [(True, 5)]
    assert {name for _, name in etcd.keepalives} == {"lease renewal"}, "renewed on its own thread only"


def test_a_loop_wedged_past_max_loop_stall_loses_the_lead():
    etcd, changes = FakeEtcd(), []

    async def scenario() -> None:
        e = Elector(etcd, "/t", "a", None, TTL, RENEW, max_loop_stall=3 * RENEW)  # type: ignore[arg-type]
        stop, task = await leading(e, changes)
        etcd.taken = True
        held = time.monotonic()
        # held until renewals have stopped for longer than the lease lives: etcd would let it lapse
        hold_loop(lambda: time.monotonic() - max([held] + [t for t, _ in etcd.keepalives]) > TTL)
        assert not e.is_leader, "a wedged loop must not hold the lead for ever"
        assert not await e.fenced([]), "nor write as the leader"
        stop.set()
        await task

    asyncio.run(scenario())
    assert [c[:2] for c in changes] == [(True, 5), (False, 0)]


def test_etcd_ending_the_term_on_the_renewal_thread_steps_down_on_the_loop():
    """The thread records it at once (is_leader is false) and the loop steps down: on_change runs there."""
    etcd, changes = FakeEtcd(), []

    async def scenario() -> None:
        e = Elector(etcd, "/t", "a", None, TTL, RENEW)  # type: ignore[arg-type]
        stop, task = await leading(e, changes)
        etcd.ttl, etcd.taken = 0, True  # the lease expired at etcd (or was revoked); another leads
        await until_async(lambda: len(changes) == 2, "the loop to step down", timeout=10)
        assert not e.is_leader and e.epoch == 0
        with pytest.raises(Exception, match="does not lead"):
            e.fence()
        stop.set()
        await task

    asyncio.run(scenario())
    assert changes[1][:2] == (False, 0)
    assert changes[1][2] == threading.main_thread().name, "the term changes hands on the event loop's thread"


def test_max_loop_stall_is_validated_with_its_pointer():
    doc = dict(settings().raw)
    ha = {"etcd": {"endpoints": ["http://127.0.0.1:2379"]}, "lease_ttl": 6, "renew_interval": 1}
    assert parse_server_settings({**doc, "ha": ha}).ha.max_loop_stall == 60.0
    assert parse_server_settings({**doc, "ha": {**ha, "max_loop_stall": 20}}).ha.max_loop_stall == 20.0
    for bad in (1, 0.5, 0, "soon"):
        with pytest.raises(ConfigInvalid, match="/ha/max_loop_stall"):
            parse_server_settings({**doc, "ha": {**ha, "max_loop_stall": bad}})
    with pytest.raises(ValueError, match="max_loop_stall"):
        Elector(FakeEtcd(), "/t", "a", None, 6, 1, max_loop_stall=1)  # type: ignore[arg-type]
