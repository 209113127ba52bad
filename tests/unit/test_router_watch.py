"""The endpoint watch API and its client over real loopback sockets."""

import asyncio
import logging

import aiohttp
from aiohttp import web

from llmgw.router.endpoints import Endpoint, EndpointTable
from llmgw.protocol import WATCH_PATH
from llmgw.router.watch import endpoints_watch_handler, parse_watch_response, watch_endpoints
from tests.support.polling import run_async as run, until_async
from tests.support.ports import closed_port


def ep(i, **kw):
    return Endpoint(id=f"e{i}", model="m", url=f"http://127.0.0.1:{9000 + i}", **kw)


class ControlPlane:
    def __init__(self, table, wait_s=30.0, port=0, handler=None):
        self.table = table
        self.wait_s = wait_s
        self.port = port
        self.handler = handler

    async def __aenter__(self):
        app = web.Application()
        app.router.add_get(WATCH_PATH, self.handler or endpoints_watch_handler(self.table, self.wait_s))
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()


@run
async def test_handler_answers_at_once_when_behind_and_waits_otherwise():
    table = EndpointTable([ep(1)])
    async with ControlPlane(table) as cp, aiohttp.ClientSession() as s:
        async with s.get(cp.url + WATCH_PATH, params={"after": "-1"}) as r:
            doc = await r.json()
        assert doc["revision"] == 0 and doc["epoch"] == table.epoch
        assert doc["endpoints"] == [ep(1).to_dict()]
        waiting = asyncio.create_task(s.get(cp.url + WATCH_PATH, params={"after": "0", "epoch": table.epoch}))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # nothing new: the poll is held open
        table.replace([ep(2, draining=True)])
        r = await waiting
        doc = await r.json()
        assert doc["revision"] == 1 and doc["endpoints"][0]["draining"] is True
        async with s.get(cp.url + WATCH_PATH, params={"after": "1", "epoch": "other"}) as r:
            assert (await r.json())["revision"] == 1  # a different epoch is answered at once
        async with s.get(cp.url + WATCH_PATH, params={"after": "x"}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "after"


@run
async def test_handler_times_out_with_the_unchanged_set():
    table = EndpointTable([ep(1)])
    async with ControlPlane(table, wait_s=0.1) as cp, aiohttp.ClientSession() as s:
        async with s.get(cp.url + WATCH_PATH, params={"after": "0", "epoch": table.epoch}) as r:
            doc = await r.json()
    assert doc["revision"] == 0 and len(doc["endpoints"]) == 1


def test_parse_watch_response_names_bad_fields():
    import pytest
    from llmgw.router.watch import WatchError
    good = {"revision": 3, "epoch": "e", "endpoints": [ep(1).to_dict()]}
    assert parse_watch_response(good)[0] == 3
    for doc, where in [
        ([], "object"),
        ({"revision": "3", "endpoints": []}, "/revision"),
        ({"revision": 1, "endpoints": {}}, "/endpoints"),
        ({"revision": 1, "endpoints": [{"model": "m"}]}, "/endpoints/0/url"),
        ({"revision": 1, "endpoints": [ep(1).to_dict(), ep(1).to_dict()]}, "/endpoints/1/id"),
    ]:
        with pytest.raises(WatchError, match=where):
            parse_watch_response(doc)


@run
async def test_client_follows_keeps_last_known_and_recovers_after_restart(caplog):
    caplog.set_level(logging.WARNING, "llmgw.router.watch")
    remote = EndpointTable([ep(1), ep(2)])
    local = EndpointTable()
    async with ControlPlane(remote, wait_s=0.5) as cp:  # short polls: shutdown waits for held ones
        port = cp.port
        task = asyncio.create_task(watch_endpoints(cp.url, None, {"X-Test": "1"}, local,
                                                   backoff_initial=0.05, backoff_max=0.2))
        await until_async(lambda: len(local.snapshot()[1]) == 2)
        remote.replace([ep(3)])
        await until_async(lambda: [e.id for e in local.snapshot()[1]] == ["e3"])
    # the control plane is gone: the router keeps routing to what it knew
    await until_async(lambda: "keeping 1 known endpoint" in caplog.text)
    assert [e.id for e in local.snapshot()[1]] == ["e3"]
    # a restarted control plane starts its revisions over; the epoch tells the client
    fresh = EndpointTable([ep(4)])
    async with ControlPlane(fresh, wait_s=0.5, port=port):
        await until_async(lambda: [e.id for e in local.snapshot()[1]] == ["e4"])
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


@run
async def test_client_ignores_a_malformed_answer():
    local = EndpointTable([ep(9)])

    async def garbage(request):
        return web.json_response({"revision": 5, "endpoints": [{"model": "m"}]})  # no url at all

    async with ControlPlane(EndpointTable(), handler=garbage) as cp:
        task = asyncio.create_task(watch_endpoints(cp.url, None, None, local,
                                                   backoff_initial=0.05, backoff_max=0.1))
        await asyncio.sleep(0.5)
        task.cancel()
    assert [e.id for e in local.snapshot()[1]] == ["e9"] and local.revision == 0


def test_endpoint_with_an_unusable_url_is_skipped_with_a_log_line(caplog):
    caplog.set_level(logging.WARNING, "llmgw.router.watch")
    good = ep(1).to_dict()
    doc = {"revision": 4, "epoch": "e", "endpoints": [
        {"id": "bad-port", "model": "m", "url": "http://127.0.0.1:99999"}, good,
        {"id": "bad-scheme", "model": "m", "url": "not a url"}]}
    rev, _, eps = parse_watch_response(doc)
    assert rev == 4 and [e.id for e in eps] == ["e1"]
    assert "bad-port" in caplog.text and "bad-scheme" in caplog.text
    EndpointTable(eps)  # the table takes the rest


@run
async def test_retries_against_a_dead_control_plane_stay_short_and_jittered(monkeypatch, caplog):
    # A restarted control plane must be seen within seconds: the default backoff never
    # waits longer than WATCH_BACKOFF_MAX between tries, and the waits are not all equal.
    from llmgw.router import watch as watch_mod

    caplog.set_level(logging.WARNING, "llmgw.router.watch")
    port = closed_port()  # every try is refused
    waits: list[float] = []
    real_sleep = asyncio.sleep

    async def recording_sleep(delay, *a, **kw):
        if delay > 0:
            waits.append(delay)
        await real_sleep(0)

    monkeypatch.setattr(watch_mod.asyncio, "sleep", recording_sleep)
    task = asyncio.create_task(watch_endpoints(f"http://127.0.0.1:{port}", None, None, EndpointTable()))
    while len(waits) < 20:
        await real_sleep(0.01)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    assert max(waits) <= 5.0, f"a restarted control plane must be seen within seconds: {waits}"
    assert len({round(w, 6) for w in waits[-10:]}) > 1, f"capped waits must stay jittered: {waits}"
    assert "retrying in" in caplog.text


@run
async def test_the_models_that_scale_from_zero_ride_on_the_watch_only_when_there_are_some():
    remote = EndpointTable([ep(1)])
    local = EndpointTable()
    async with ControlPlane(remote, wait_s=0.5) as cp, aiohttp.ClientSession() as s:
        async with s.get(cp.url + WATCH_PATH, params={"after": "-1"}) as r:
            assert "from_zero" not in await r.json()  # the answer a router that predates it always got
        task = asyncio.create_task(watch_endpoints(cp.url, None, None, local, backoff_initial=0.05))
        await until_async(lambda: len(local.snapshot()[1]) == 1)
        remote.replace([], ["m", "n"])
        await until_async(lambda: local.from_zero == {"m", "n"} and not local.snapshot()[1])
        async with s.get(cp.url + WATCH_PATH, params={"after": "-1"}) as r:
            assert (await r.json())["from_zero"] == ["m", "n"]
        task.cancel()


def test_a_malformed_from_zero_is_refused_at_its_pointer():
    import pytest
    from llmgw.router.watch import WatchError, parse_from_zero
    assert parse_from_zero({}) == frozenset()
    for raw, where in [({"a": 1}, "/from_zero"), (["m", 3], "/from_zero/1"), ([""], "/from_zero/0")]:
        with pytest.raises(WatchError, match=where):
            parse_from_zero({"from_zero": raw})
