"""POST /v1/router/allowance (controlplane/allowance_api.py): who may lease, bad bodies, new books, a new term."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from llmgw.controlplane.allowance_api import AllowanceAPI
from llmgw.protocol import ALLOWANCE_PATH

ASK = {"key": "k", "scope": "", "dimension": "requests", "limit": 10, "span": 60, "need": 1}


def fake_cp(now: list[float]) -> SimpleNamespace:
    return SimpleNamespace(clock=lambda: now[0], leader_epoch=1,
                           settings=SimpleNamespace(router_allowance=SimpleNamespace(lease_seconds=2.0)))


def run(cp, steps):
    api = AllowanceAPI(cp, lambda request: request.headers.get("X-Test-Router"))
    app = web.Application()
    app.router.add_post(ALLOWANCE_PATH, api.handle)

    async def go():
        async with TestClient(TestServer(app)) as c:
            return await steps(c, api)
    return asyncio.run(go())


def test_only_a_router_leases_a_bad_body_changes_nothing_and_new_books_answer_503_until_a_lease_time_passed():
    now = [100.0]
    cp = fake_cp(now)

    async def steps(c, api):
        r = await c.post(ALLOWANCE_PATH, json={"instance": "w", "asks": [ASK]})
        assert r.status == 403
        router = {"X-Test-Router": "router-a"}
        r = await c.post(ALLOWANCE_PATH, json={"instance": "w", "asks": [{**ASK, "limit": -1}]}, headers=router)
        assert r.status == 400 and (await r.json())["errors"][0]["pointer"] == "/asks/0/limit"
        r = await c.post(ALLOWANCE_PATH, data=b'{"instance": "w", "asks": [], "x": NaN}', headers=router)
        assert r.status == 400
        r = await c.post(ALLOWANCE_PATH, json={"instance": "w", "asks": [ASK]}, headers=router)
        assert r.status == 503 and r.headers["Retry-After"] == "2"  # leases of an earlier process end first
        now[0] += 2.0
        r = await c.post(ALLOWANCE_PATH, json={"instance": "w", "asks": [ASK]}, headers=router)
        assert r.status == 200
        lease = (await r.json())["answers"][0]
        assert lease["amount"] == 5 and lease["ttl"] == 2.0
        assert api.book.outstanding(("k", "", "requests"), now[0]) == 5
        # another router cannot return it
        r = await c.post(ALLOWANCE_PATH, headers={"X-Test-Router": "router-b"},
                         json={"instance": "w", "returns": [{"lease": lease["lease"], "unused": 5, "idle": 0}]})
        assert r.status == 200 and api.book.outstanding(("k", "", "requests"), now[0]) == 5
        # a new term (ha failover): the books start from zero and hold grants for one lease time
        cp.leader_epoch = 2
        r = await c.post(ALLOWANCE_PATH, json={"instance": "w", "asks": [ASK]}, headers=router)
        assert r.status == 503 and api.book.outstanding(("k", "", "requests"), now[0]) == 0
        return True

    assert run(cp, steps)


def test_concurrency_slots_are_renewed_over_the_route_and_a_short_renewal_says_when_to_retry():
    now = [100.0]
    cp = fake_cp(now)
    conc = {"key": "k", "scope": "", "dimension": "concurrent_requests", "limit": 2, "span": 0, "need": 1}

    async def steps(c, api):
        now[0] += 2.0
        a, b = {"X-Test-Router": "router-a"}, {"X-Test-Router": "router-b"}
        r = await c.post(ALLOWANCE_PATH, json={"instance": "w", "asks": [{**conc, "held": -1}]}, headers=a)
        assert r.status == 400 and (await r.json())["errors"][0]["pointer"] == "/asks/0/held"
        r = await c.post(ALLOWANCE_PATH, json={"instance": "w", "asks": [{**ASK, "span": 0}]}, headers=a)
        assert r.status == 400 and (await r.json())["errors"][0]["pointer"] == "/asks/0/span"  # a window needs one
        got = []
        for h in (a, b):
            r = await c.post(ALLOWANCE_PATH, json={"instance": "w", "asks": [conc]}, headers=h)
            got.append((await r.json())["answers"][0])
        assert [g["amount"] for g in got] == [1, 1] and "retry_after" not in got[0]
        # router-a keeps its running request and asks for one more: kept, none to add, retry in 1 s
        r = await c.post(ALLOWANCE_PATH, json={"instance": "w", "asks": [{**conc, "held": 1}]}, headers=a)
        kept = (await r.json())["answers"][0]
        assert kept["amount"] == 1 and kept["retry_after"] == 1.0 and kept["lease"] != got[0]["lease"]
        assert api.book.outstanding(("k", "", "concurrent_requests"), now[0]) == 2
        return True

    assert run(cp, steps)
