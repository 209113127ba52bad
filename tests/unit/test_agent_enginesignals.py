"""The agent's reads of its engines' signals over real HTTP: bounded in size and time, with the engine key,
and only what the dead band lets through goes on the stream."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import aiohttp
from aiohttp import web

from llmgw.agent.enginesignals import EngineSignals, read_page
from llmgw.agent.shardstate import ShardState

KEY = "k" * 32


async def serving(page: dict, delay: dict):
    async def metrics(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {KEY}":
            return web.Response(status=401)
        await asyncio.sleep(delay["s"])
        return web.Response(text=page["text"])

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def test_reads_are_bounded_and_carry_the_engine_key():
    async def go():
        page, delay = {"text": "vllm:num_requests_waiting 3\n"}, {"s": 0.0}
        runner, url = await serving(page, delay)
        try:
            async with aiohttp.ClientSession() as s:
                auth = {"headers": {"Authorization": f"Bearer {KEY}"}}
                assert await read_page(s, url, auth, 2.0) == page["text"]
                assert await read_page(s, url, {}, 2.0) is None  # 401 without the key
                page["text"] = "x" * 5000
                assert await read_page(s, url, auth, 2.0, limit=4096) is None  # longer than the bound
                delay["s"] = 0.5
                assert await read_page(s, url, auth, 0.2) is None  # no answer within the time
        finally:
            await runner.cleanup()
    asyncio.run(go())


def test_one_round_sends_what_moved_and_nothing_for_an_engine_not_ready():
    async def go():
        page, delay = {"text": 'vllm:num_requests_waiting{engine="0"} 3\n'}, {"s": 0.0}
        runner, url = await serving(page, delay)
        sent: list[dict] = []
        try:
            async with aiohttp.ClientSession() as s:
                kwargs = {"headers": {"Authorization": f"Bearer {KEY}"}}
                ready = SimpleNamespace(state=ShardState.READY, port=1, spec={"profile": {"engine": "vllm"}})
                starting = SimpleNamespace(state=ShardState.STARTING, port=2, spec={"profile": {"engine": "vllm"}})
                sup = SimpleNamespace(shards={"a/r0": ready, "b/r0": starting},
                                      driver=SimpleNamespace(engine_request=lambda shard: (s, url, kwargs)))
                sig = EngineSignals(sup, sent.append)
                sig.period, sig.refresh = 5.0, 30.0
                sig.wanted = {"a/r0": ("queue_depth", 0.8), "b/r0": ("queue_depth", 0.8)}
                assert await sig.once() == {"type": "engine_signals",
                                            "shards": [{"shard_id": "a/r0", "signal": "queue_depth", "value": 3.0}]}
                assert await sig.once() is None  # unchanged
                page["text"] = 'vllm:num_requests_waiting{engine="0"} 1\n'
                assert (await sig.once())["shards"][0]["value"] == 1.0
                assert sig.reads == 3 and len(sent) == 2
        finally:
            await runner.cleanup()
    asyncio.run(go())


def test_nothing_is_read_until_asked_and_an_empty_ask_stops_the_reads():
    async def go():
        sup = SimpleNamespace(shards={}, driver=None)
        sig = EngineSignals(sup, lambda m: None)
        assert sig._task is None
        sig.want({"type": "engine_signals_wanted", "period": 0.1, "refresh": 1.0,
                  "shards": [{"shard_id": "a/r0", "signal": "queue_depth", "deadband": 0.5}]})
        assert sig._task is not None and sig.wanted == {"a/r0": ("queue_depth", 0.5)}
        await asyncio.sleep(0.25)
        sig.want({"type": "engine_signals_wanted", "period": 0.1, "refresh": 1.0, "shards": []})
        assert sig._task is None and sig.wanted == {}
    asyncio.run(go())
