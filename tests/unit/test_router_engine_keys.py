"""Engine keys in the router's endpoint set: who is told them, and that they never print."""

from __future__ import annotations

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from llmgw.router.endpoints import Endpoint, EndpointError, EndpointTable
from llmgw.protocol import WATCH_PATH
from llmgw.router.watch import REVEAL_KEYS, endpoints_watch_handler, parse_watch_response
from tests.support.polling import run_async as run

KEY = "engine-key-" + "q" * 32


def keyed(i: int) -> Endpoint:
    return Endpoint(id=f"e{i}", model="m", url=f"http://127.0.0.1:{9000 + i}", api_key=f"{KEY}{i}")


def test_the_key_is_kept_out_of_reprs_and_out_of_the_json_unless_asked():
    ep = keyed(1)
    assert KEY not in repr(ep)
    assert "api_key" not in ep.to_dict()
    assert ep.to_dict(with_key=True)["api_key"] == f"{KEY}1"
    assert Endpoint.from_dict(ep.to_dict(with_key=True)) == ep
    assert Endpoint.from_dict(ep.to_dict()).api_key is None


@pytest.mark.parametrize("bad", ["", "has space", "tab\t", "é" * 40, 12])
def test_an_unusable_key_names_its_field(bad):
    with pytest.raises(EndpointError, match="/endpoints/0/api_key"):
        Endpoint.from_dict({"model": "m", "url": "http://h:1", "api_key": bad}, where="/endpoints/0")


@run
async def test_the_watch_carries_keys_only_to_requests_the_api_marked_as_a_router():
    table = EndpointTable([keyed(1), keyed(2)])
    watch = endpoints_watch_handler(table)

    @web.middleware
    async def as_router(request, handler):
        if request.headers.get("X-Test-Role") == "router":
            request[REVEAL_KEYS] = True
        return await handler(request)

    app = web.Application(middlewares=[as_router])
    app.router.add_get(WATCH_PATH, watch)
    async with TestClient(TestServer(app)) as c:
        plain = await (await c.get(WATCH_PATH, params={"after": "-1"})).json()
        router = await (await c.get(WATCH_PATH, params={"after": "-1"}, headers={"X-Test-Role": "router"})).json()
    assert all("api_key" not in e for e in plain["endpoints"])
    assert [e["api_key"] for e in router["endpoints"]] == [f"{KEY}1", f"{KEY}2"]
    _, _, eps = parse_watch_response(router)
    assert [e.api_key for e in eps] == [f"{KEY}1", f"{KEY}2"]
