"""A router's periodic posts follow the control planes: one that is down or cannot take them moves the next post on."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from aiohttp import web

from llmgw.router.cpposts import ReportPoster
from tests.support.ports import free_port


def test_a_post_that_finds_nobody_or_a_5xx_goes_to_the_next_control_plane(caplog):
    async def run() -> list[tuple[str, str]]:
        got: list[dict] = []

        async def take(request: web.Request) -> web.Response:
            got.append(await request.json())
            return web.json_response({"accepted": 1}, status=202)

        async def busy(request: web.Request) -> web.Response:
            return web.json_response({"error": "no leader"}, status=503)

        app = web.Application()
        app.router.add_post("/ok/v1/router/load", take)
        app.router.add_post("/busy/v1/router/load", busy)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        down = f"http://127.0.0.1:{free_port()}"  # nobody listens
        poster = ReportPoster([down, f"http://127.0.0.1:{port}/busy", f"http://127.0.0.1:{port}/ok/"],
                              "/v1/router/load", logging.getLogger("test.cpposts"))
        seen = []
        try:
            async with aiohttp.ClientSession() as s:
                for n in range(4):
                    target = poster.current
                    problem = await poster.post(s, {"n": n}, "retrying")
                    seen.append((target.rsplit(":", 1)[1], problem.split(":")[0]))
        finally:
            await runner.cleanup()
        assert [d["n"] for d in got] == [2, 3]  # both posts after the two that could not be taken
        return seen

    with caplog.at_level(logging.INFO, logger="test.cpposts"):
        seen = asyncio.run(run())
    assert [p for _, p in seen] == ["ClientConnectorError", "HTTP 503", "", ""]
    assert seen[2][0].endswith("/ok/v1/router/load") and seen[3] == seen[2]  # it stays on the one that takes them
    assert [r.levelname for r in caplog.records] == ["WARNING", "WARNING", "INFO"]
