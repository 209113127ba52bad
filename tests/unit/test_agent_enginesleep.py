"""The agent's engine sleep calls against a real HTTP server: what it calls, when it refuses, what it reports."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from aiohttp import web

from llmgw.agent.enginesleep import EngineSleep
from llmgw.agent.shard import Shard
from llmgw.agent.shardstate import ShardState


class Supervisor:
    """What EngineSleep uses of the agent's supervisor: its shards, the engine's address, emit."""

    def __init__(self, url: str, session: aiohttp.ClientSession):
        self.url, self.session = url, session
        self.shards: dict[str, Shard] = {}
        self.sent: list[dict] = []

    def engine_request(self, shard):
        return self.session, self.url, {"headers": {"Authorization": f"Bearer {shard.spec['api_key']}"}}

    @property
    def driver(self):
        return self

    def emit(self, msg):
        self.sent.append(msg)

    def status_message(self, shard):
        return {"shard_id": shard.shard_id, "sleeping": shard.sleeping}


def shard(sid: str, sleep_mode: bool = True, state: ShardState = ShardState.READY) -> Shard:
    spec = {"shard_id": sid, "replica_id": sid, "rank": 0, "api_key": "k" * 32}
    if sleep_mode:
        spec["sleep_mode"] = True
    return Shard(spec=spec, state=state, started_at=time.monotonic(), deadline=time.monotonic() + 60, port=1)


def test_sleep_and_wake_call_the_engine_one_at_a_time_and_report_only_what_it_did():
    async def run():
        calls: list[str] = []
        answer = {"status": 200}

        async def handler(request: web.Request) -> web.Response:
            calls.append(f"{request.path_qs} {request.headers.get('Authorization', '')[:9]}")
            await asyncio.sleep(0.2 if request.path == "/sleep" else 0)  # a wake would overtake a sleep
            if request.path == "/is_sleeping":
                return web.json_response({"is_sleeping": True})
            return web.Response(status=answer["status"])

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        async with aiohttp.ClientSession() as session:
            sup = Supervisor(f"http://127.0.0.1:{port}", session)
            sup.shards = {"a": shard("a"), "plain": shard("plain", sleep_mode=False),
                          "starting": shard("starting", state=ShardState.STARTING)}
            es = EngineSleep(sup)
            # refused without a call: not launched in sleep mode, not Ready, unknown
            assert not await es.sleep("plain", 1) and not await es.sleep("starting", 1) and not await es.wake("x")
            assert calls == []
            # a sleep and a wake sent together run in order, never overlapping
            ok = await asyncio.gather(es.sleep("a", 2), es.wake("a"))
            assert ok == [True, True] and calls == ["/sleep?level=2 Bearer kk", "/wake_up Bearer kk"], calls
            assert sup.sent == [{"shard_id": "a", "sleeping": True}, {"shard_id": "a", "sleeping": False}]
            # an engine that refuses: nothing reported, the shard still awake
            answer["status"] = 500
            assert not await es.sleep("a", 1) and len(sup.sent) == 2 and not sup.shards["a"].sleeping
            # after a restart only the engine knows: recheck asks it and reports
            await es.recheck()
            assert calls[-1].startswith("/is_sleeping") and sup.sent[-1] == {"shard_id": "a", "sleeping": True}
        await runner.cleanup()
    asyncio.run(run())
