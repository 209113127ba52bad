"""Reference point: the thinnest aiohttp relay (no auth, routing, retries, metrics, event splitting).

    python benchmarks/router/bare_relay.py UPSTREAM_URL PORT [/slow=SLOW_URL]

Measured beside the llmgw router it separates what the router's own logic costs
from what aiohttp's client and server cost per request and per chunk.
"""

import asyncio
import sys

import aiohttp
import uvloop
from aiohttp import web


async def main(upstream: str, port: int, routes: dict[str, str]) -> None:
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        base, path = upstream, request.path
        for prefix, url in routes.items():
            if path.startswith(prefix + "/"):
                base, path = url, path[len(prefix):]
        async with session.post(base + path, data=body, headers={"Content-Type": "application/json"}) as r:
            if r.headers.get("Content-Type", "").startswith("text/event-stream"):
                out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await out.prepare(request)
                async for data in r.content.iter_any():
                    await out.write(data)
                await out.write_eof()
                return out
            return web.Response(status=r.status, body=await r.read(), content_type="application/json")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": []})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_route("*", "/{tail:.*}", relay)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


if __name__ == "__main__":
    extra = dict(a.split("=", 1) for a in sys.argv[3:])
    uvloop.run(main(sys.argv[1], int(sys.argv[2]), extra))
