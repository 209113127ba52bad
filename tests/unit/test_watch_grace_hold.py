"""A router's endpoint poll held through the startup grace waits for the grace as it is when it
ends, not as it was when the poll began: agents still arriving hold the grace longer
(``lifecycletimers``), and a poll that woke at the first end answered 503 with the fleet back."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from llmgw.controlplane.api import grace_aware_watch
from llmgw.controlplane.lifecycletimers import LifecycleTimers
from llmgw.settings import Lifecycle


def test_a_poll_waits_out_a_grace_that_grows_while_it_waits():
    lc = Lifecycle(startup_grace=0.4)
    timers = LifecycleTimers(time.monotonic())
    cp = SimpleNamespace(timers=timers, clock=time.monotonic, settings=SimpleNamespace(lifecycle=lc))

    async def endpoints(request: web.Request) -> web.Response:
        return web.json_response({"endpoints": []})

    async def scenario() -> int:
        held = grace_aware_watch(cp, endpoints)  # type: ignore[arg-type]

        async def arrive() -> None:
            await asyncio.sleep(0.3)
            timers.note_arrival(time.monotonic(), "registered", lc)  # the grace now ends 0.4 s after this

        arrival = asyncio.ensure_future(arrive())
        resp = await held(make_mocked_request("GET", "/v1/router/endpoints"))
        await arrival
        return resp.status

    assert asyncio.run(scenario()) == 200  # 503 when it gave up at the grace's first end
