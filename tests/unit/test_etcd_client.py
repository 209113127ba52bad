"""AsyncEtcd's endpoint handling against small HTTP servers on loopback that answer as etcd's gateway does.

A member whose raft leader died holds a keep-alive until a new leader is
elected, then answers it: a renewal must keep waiting on it (and ask the
next member meanwhile), not give it up after the per-endpoint timeout.  A
write is never sent to two members at once, and no call outlives its budget.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from llmgw.controlplane.etcd import AsyncEtcd, EtcdUnavailable, _Calls, b64
from llmgw.controlplane.leader import Elector, Term
from tests.support.ports import free_port

TIMEOUT = 0.2


async def member(delay: float | None, seen: list[str], answer: dict | None = None) -> tuple[web.AppRunner, str]:
    """A fake member answering every call after ``delay`` seconds (None: never)."""

    async def handle(request: web.Request) -> web.Response:
        seen.append(request.path)
        await asyncio.sleep(delay if delay is not None else 3600)
        return web.json_response(answer or {"header": {}, "result": {"TTL": "3"}})

    app = web.Application()
    app.router.add_post("/{tail:.*}", handle)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def refusing() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


def run(scenario):
    return asyncio.run(scenario())


def test_a_hedged_keepalive_waits_on_a_member_answering_after_an_election_and_sticks_to_it():
    async def scenario():
        seen_slow, seen_hung = [], []
        slow, slow_url = await member(4 * TIMEOUT, seen_slow)  # holds the call until "a new leader" is elected
        hung, hung_url = await member(None, seen_hung)
        etcd = AsyncEtcd((refusing(), slow_url, hung_url), timeout=TIMEOUT)
        try:
            assert await etcd.keepalive(7, budget=20 * TIMEOUT) == 3
            assert seen_slow and seen_hung, "the silent member did not hold back the next one"
            assert etcd.endpoints[0] == slow_url, "the member that answered is asked first next time"
        finally:
            await etcd.aclose()
            await slow.cleanup()
            await hung.cleanup()

    run(scenario)


def test_a_write_goes_to_one_member_at_a_time_and_a_silent_one_is_given_up_after_the_timeout():
    async def scenario():
        seen_slow, seen_fast = [], []
        slow, slow_url = await member(4 * TIMEOUT, seen_slow, {"header": {}, "succeeded": True})
        fast, fast_url = await member(0, seen_fast, {"header": {}, "succeeded": True})
        etcd = AsyncEtcd((slow_url, fast_url), timeout=TIMEOUT)
        try:
            ok, _ = await etcd.txn([], [etcd.put_op("k", b"v")], budget=20 * TIMEOUT)
            assert ok and seen_slow and seen_fast
            assert etcd.endpoints[0] == fast_url
            # the reads-only txn that renewals use is hedged: the slow member is waited for past the timeout
            etcd.endpoints = [slow_url, hung_url := refusing()]
            ok, _ = await etcd.txn([], [], budget=20 * TIMEOUT)
            assert ok and etcd.endpoints[0] == slow_url and hung_url in etcd.endpoints
        finally:
            await etcd.aclose()
            await slow.cleanup()
            await fast.cleanup()

    run(scenario)


def test_no_call_outlives_its_budget_and_the_error_names_every_member():
    async def scenario():
        hung, hung_url = await member(None, [])
        refused = refusing()
        etcd = AsyncEtcd((hung_url, refused, "http://127.0.0.1:9"), timeout=TIMEOUT)
        try:
            with pytest.raises(EtcdUnavailable) as e:
                await etcd.keepalive(7, budget=3 * TIMEOUT)
            assert hung_url in str(e.value) and refused in str(e.value) and "no answer in time" in str(e.value)
            with pytest.raises(EtcdUnavailable, match="no answer in 0.2s"):
                await etcd.get("k")  # not hedged: the silent member is given up after the timeout
        finally:
            await etcd.aclose()
            await hung.cleanup()

    run(scenario)


class RecordingEtcd:
    """Records the budget each renewal call is given."""

    def __init__(self) -> None:
        self.budgets: list[tuple[str, float | None]] = []

    async def keepalive(self, lease: int, budget: float | None = None) -> int:
        self.budgets.append(("keepalive", budget))
        return 3

    async def txn(self, compare, success, failure=None, budget=None):
        self.budgets.append(("txn", budget))
        return True, {}


def test_a_renewal_may_take_until_the_leaders_deadline_and_no_longer():
    now = [100.0]
    etcd = RecordingEtcd()
    e = Elector(etcd, "/t", "a", None, 3, 0.5, clock=lambda: now[0])  # type: ignore[arg-type]
    e.term, e._deadline = Term(5, 5, 7), 101.5
    assert asyncio.run(e.renew_once())
    assert etcd.budgets == [("keepalive", 1.5), ("txn", 1.5)]
    assert e._deadline == 100.0 + 3 - 0.5, "the deadline runs from when the renewal was sent"
    now[0] = 103.0  # past the deadline: is_leader is false and nothing waits
    assert not e.is_leader


class RevokingEtcd(RecordingEtcd):
    def __init__(self) -> None:
        super().__init__()
        self.revoked: list[int] = []

    async def revoke(self, lease: int) -> None:
        self.revoked.append(lease)


def test_a_leader_that_stepped_down_revokes_its_old_lease_on_the_way_out():
    """It stepped down before the lease could lapse: until revoked, the key blocks the standby."""
    now = [100.0]
    etcd = RevokingEtcd()
    changes = []
    e = Elector(etcd, "/t", "a", None, 3, 0.5, clock=lambda: now[0],  # type: ignore[arg-type]
                on_change=lambda leading, epoch: changes.append(leading))
    e.term, e._deadline = Term(5, 5, 7), 101.5
    now[0] = 102.0
    assert not e.is_leader and changes == [False]
    asyncio.run(e.resign())
    assert etcd.revoked == [7]
    asyncio.run(e.resign())
    assert etcd.revoked == [7], "revoked once"


class CampaignEtcd(_Calls):
    """The key already exists under our own lease: an earlier campaign of ours won, its answer lost."""

    def __init__(self, lease: int, key_lease: int) -> None:
        self.lease, self.key_lease = lease, key_lease

    async def keepalive(self, lease: int, budget: float | None = None) -> int:
        return 3 if lease == self.lease else 0

    async def grant(self, ttl: int) -> int:
        return self.lease

    async def txn(self, compare, success, failure=None, budget=None):
        kv = {"key": b64("/t/leader"), "value": b64(json.dumps({"name": "a", "url": None})),
              "create_revision": "5", "mod_revision": "6", "lease": str(self.key_lease)}
        return False, {"header": {"revision": "9"}, "responses": [{"response_range": {"kvs": [kv]}}]}


def test_a_campaign_finding_the_key_under_its_own_lease_leads_on_it():
    now = [100.0]
    e = Elector(CampaignEtcd(7, key_lease=7), "/t", "a", None, 3, 0.5, clock=lambda: now[0])  # type: ignore[arg-type]
    e._lease = 7
    assert asyncio.run(e.campaign_once())
    assert e.is_leader and e.term == Term(5, 6, 7) and e.epoch == 5
    assert e._deadline == 100.0 + 3 - 0.5


def test_a_campaign_finding_the_key_under_another_lease_stands_by():
    e = Elector(CampaignEtcd(7, key_lease=8), "/t", "a", None, 3, 0.5)  # type: ignore[arg-type]
    assert not asyncio.run(e.campaign_once())
    assert not e.is_leader and e.leader is not None and e.leader.epoch == 5
