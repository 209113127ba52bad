"""The benchmark's file server: aiohttp.web's FileResponse (sendfile, Range, ETag) on loopback.

Run as its own process so the server never competes with the client under
test for a GIL; both clients download from this same process.  It prints
``listening PORT`` once it accepts connections.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from aiohttp import web


async def main(root: Path, host: str) -> None:
    async def handle(request: web.Request) -> web.StreamResponse:
        path = (root / request.match_info["name"]).resolve()
        if root not in path.parents or not path.is_file():
            raise web.HTTPNotFound()
        return web.FileResponse(path, chunk_size=1 << 20)

    app = web.Application()
    app.router.add_get("/{name:.+}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(f"listening {port}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("root", type=Path)
    ap.add_argument("--host", default="127.0.0.1")
    a = ap.parse_args()
    asyncio.run(main(a.root.resolve(), a.host))
