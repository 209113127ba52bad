"""The hold queue for sleeping models: held until the table shows one awake, 503 + Retry-After past its bounds."""

from __future__ import annotations

import asyncio

import pytest

from llmgw.router.balancing import LeastOutstanding
from llmgw.router.endpoints import Endpoint, EndpointTable
from llmgw.router.errors import RouterError
from llmgw.router.holdqueue import HoldQueue, all_asleep
from llmgw.router.loadreport import in_flight
from llmgw.router.metrics import RouterMetrics
from llmgw.router.runtime import Routing
from llmgw.router.settings import Hold, RouterSettings

ASLEEP = Endpoint("e1", "m", "http://127.0.0.1:9001", replica_id="r1", sleeping=True)
AWAKE = Endpoint("e1", "m", "http://127.0.0.1:9001", replica_id="r1")


def routing(*eps: Endpoint) -> Routing:
    return Routing(EndpointTable(list(eps)), RouterSettings(), RouterMetrics(), LeastOutstanding())


def test_a_sleeping_endpoint_is_never_picked_and_an_awake_one_needs_no_hold():
    r = routing(ASLEEP, Endpoint("e2", "m", "http://127.0.0.1:9002", draining=True))
    group = r.group("m")
    why = r.pick(group, set(), None)
    assert all_asleep(group) and isinstance(why, RouterError)
    assert why.status == 503 and "1 asleep" in why.message, why.message  # not "at their concurrency limit"
    assert not all_asleep(routing(AWAKE, ASLEEP.__class__("e3", "m", "http://127.0.0.1:9003", sleeping=True)
                                  ).group("m"))


def test_held_requests_are_released_together_when_the_table_shows_one_awake():
    async def run():
        r = routing(ASLEEP)
        woken: list[str] = []
        q = HoldQueue(r, Hold(max_requests=8, deadline=30), woken.append)
        held = [asyncio.ensure_future(q.admit("m", r.group("m"))) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert q.held == {"m": 3} and woken == ["m"]  # one wake asked for the three
        assert in_flight(r) == {"r1": 3}  # the autoscaler sees them while the model wakes
        r.table.replace([AWAKE])
        groups = await asyncio.wait_for(asyncio.gather(*held), 5)
        assert all(not all_asleep(g) for g in groups) and q.held == {} and in_flight(r) == {}
        assert r.pick(groups[0], set(), None).endpoint == AWAKE
    asyncio.run(run())


@pytest.mark.parametrize("hold, words", [(Hold(max_requests=0, deadline=30), "held already"),
                                         (Hold(max_requests=4, deadline=0.1), "not awake within 0.1 s")])
def test_past_either_bound_the_answer_is_503_with_retry_after(hold, words):
    async def run():
        r = routing(ASLEEP)
        q = HoldQueue(r, hold, lambda m: None)
        with pytest.raises(RouterError) as e:
            await q.admit("m", r.group("m"))
        err = e.value
        assert (err.status, err.code, err.retry_after) == (503, "model_waking", 1 if hold.deadline < 1 else 30)
        assert words in err.message and q.held == {}
    asyncio.run(run())


def test_a_model_that_scales_from_zero_is_known_without_endpoints_and_held_until_one_serves():
    """The table's ``from_zero`` names it: listed, held (not 404) with the held count in its wake,
    released when the replica its wake started appears; a model the table does not name stays unknown."""
    async def run():
        table = EndpointTable([])
        table.replace([Endpoint("d", "m", "http://127.0.0.1:9002", replica_id="r0", draining=True)], ["m"])
        r = Routing(table, RouterSettings(), RouterMetrics(), LeastOutstanding())
        assert r.models() == ["m"] and r.group("other") is None
        group = r.group("m")
        assert all_asleep(group)  # its one endpoint drains away: held, not "no endpoint can take it"
        woken: list[tuple] = []
        q = HoldQueue(r, Hold(max_requests=8, deadline=30), lambda *a: woken.append(a))
        held = [asyncio.ensure_future(q.admit("m", group)) for _ in range(2)]
        await asyncio.sleep(0.05)
        assert woken == [("m", 1)] and q.held == {"m": 2}  # the first asked, holding one so far
        r.table.replace([], ["m"])  # the draining one gone: still held
        await asyncio.sleep(0.05)
        r.table.replace([AWAKE], ["m"])
        groups = await asyncio.wait_for(asyncio.gather(*held), 5)
        assert r.pick(groups[0], set(), None).endpoint == AWAKE and q.held == {}
    asyncio.run(run())
