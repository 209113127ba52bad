"""Leader election and the shared store against a real etcd on loopback.

Two electors (as two control planes would run them) campaign for one key:
one leads, the other stands by and takes over when the leader resigns or
its lease lapses; a leader that cannot reach etcd steps down before its
lease can lapse; a deposed leader's fenced writes fail at etcd.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from etcdproc import Etcd
from llmgw.controlplane.etcd import AsyncEtcd, BlockingEtcd
from llmgw.controlplane.leader import Elector
from llmgw.controlplane.store import ControlPlaneStore, EtcdBackend, StoreError
from tests.support.polling import until_async

pytestmark = pytest.mark.integration

TTL, RENEW = 3, 0.5


def elector(url: str, name: str, prefix: str = "/t") -> Elector:
    return Elector(AsyncEtcd((url,), timeout=1.0), prefix, name, f"https://{name}:8443", TTL, RENEW)


async def wait_for(pred, what: str, timeout: float = 20.0) -> float:
    """Seconds until ``pred`` held (a takeover's duration is what some tests measure)."""
    start = time.monotonic()
    await until_async(pred, what, timeout)
    return time.monotonic() - start


def test_one_leads_the_other_stands_by_and_takes_over_with_a_higher_epoch(tmp_path):
    async def scenario(url: str) -> None:
        a, b = elector(url, "a"), elector(url, "b")
        stop_a, stop_b = asyncio.Event(), asyncio.Event()
        ta = asyncio.create_task(a.run(stop_a))
        await wait_for(lambda: a.is_leader, "a to lead")
        tb = asyncio.create_task(b.run(stop_b))
        await wait_for(lambda: b.leader is not None, "b to see the leader")
        assert not b.is_leader and b.leader.name == "a" and b.leader.url == "https://a:8443"
        first = a.epoch
        stop_a.set()
        await ta
        await a.resign()  # a clean stop hands over at once
        took = await wait_for(lambda: b.is_leader, "b to take over", timeout=TTL + 5)
        assert took < TTL, "a resignation is taken over within a renew interval, not a lease"
        assert b.epoch > first, "every later leader has a higher term"
        assert not a.is_leader
        stop_b.set()
        await tb
        await b.resign()

    with Etcd(tmp_path) as etcd:
        asyncio.run(scenario(etcd.url))


def test_a_paused_leader_is_replaced_once_its_lease_lapses_and_its_writes_are_refused(tmp_path):
    async def scenario(url: str) -> None:
        a, b = elector(url, "a"), elector(url, "b")
        assert await a.campaign_once()
        old = a.epoch
        fence_before = a.fence()
        # a is "paused": it renews nothing; b campaigns until the lease lapses at etcd
        stop_b = asyncio.Event()
        tb = asyncio.create_task(b.run(stop_b))
        took = await wait_for(lambda: b.is_leader, "b to take over", timeout=TTL + 5)
        assert took <= TTL + 2 * RENEW + 1
        assert b.epoch > old
        # a wakes: its own clock already says it does not lead, and etcd refuses its fenced write
        assert not a.is_leader and a.epoch == 0
        ok, _ = await a.etcd.txn(fence_before, [a.etcd.put_op("/t/x", b"stale")])
        assert not ok, "a write fenced on the old leader key is refused at etcd"
        assert await b.fenced([b.etcd.put_op("/t/x", b"fresh")])
        stop_b.set()
        await tb
        await b.resign()

    with Etcd(tmp_path) as etcd:
        asyncio.run(scenario(etcd.url))


def test_a_leader_cut_from_etcd_steps_down_before_its_lease_lapses(tmp_path):
    async def scenario(etcd: Etcd) -> None:
        a = elector(etcd.url, "a")
        changes: list[tuple[bool, int]] = []
        a.on_change = lambda leading, epoch: changes.append((leading, epoch))
        stop = asyncio.Event()
        task = asyncio.create_task(a.run(stop))
        await wait_for(lambda: a.is_leader, "a to lead")
        await asyncio.sleep(2 * RENEW)  # a renewal or two
        etcd.proc.signal(signal.SIGSTOP)  # etcd stops answering: keep-alives time out
        cut = time.monotonic()
        try:
            await wait_for(lambda: not a.is_leader, "a to step down", timeout=TTL + 5)
            stepped = time.monotonic() - cut
        finally:
            etcd.proc.signal(signal.SIGCONT)
        assert stepped < TTL, f"stepped down {stepped:.1f}s after the cut; the lease lives {TTL}s"
        assert changes[-1] == (False, 0)
        stop.set()
        await task

    with Etcd(tmp_path) as etcd:
        asyncio.run(scenario(etcd))


def test_the_store_on_etcd_keeps_cordons_and_epochs_and_refuses_a_deposed_writer(tmp_path):
    async def lead(e: Elector) -> bool:
        return await e.campaign_once()

    with Etcd(tmp_path) as etcd:
        a = elector(etcd.url, "a")
        assert asyncio.run(lead(a))
        client = BlockingEtcd((etcd.url,))
        store = ControlPlaneStore(EtcdBackend(client, "/t", fence=a.fence))
        store.set_cordon("n1", "cordoned")
        first = store.next_epoch()
        again = ControlPlaneStore(EtcdBackend(BlockingEtcd((etcd.url,)), "/t"))  # a successor reads it back
        assert again.intent.cordons == {"n1": "cordoned"}
        assert again.next_epoch() > first
        a.term = None  # deposed (as after a missed renewal)
        with pytest.raises(StoreError, match="does not lead"):
            store.set_cordon("n2", "cordoned")
        assert store.intent.cordons == {"n1": "cordoned"}
        with pytest.raises(StoreError, match="etcd"):
            ControlPlaneStore(EtcdBackend(BlockingEtcd(("http://127.0.0.1:9",), timeout=0.5), "/t"))
