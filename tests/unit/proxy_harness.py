"""The router's proxy against in-process engines (no tests here): scripted event streams, a router
on them, and an event loop runner."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from llmgw.router.app import PROXY_KEY, RUNNER_KWARGS, build_app
from llmgw.router.auth import hash_key
from llmgw.router.endpoints import Endpoint, EndpointTable
from llmgw.router.settings import RouterSettings


def chunk(i: int) -> bytes:
    return b'data: {"choices":[{"index":0,"delta":{"content":"t%d"},"finish_reason":null}]}\n\n' % i


ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'


DONE = b"data: [DONE]\n\n"


class Engine:
    """A scripted upstream.  ``behaviour(request, body)`` returns the response."""

    def __init__(self, behaviour):
        self.behaviour = behaviour
        self.requests: list[tuple[object, bytes]] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> "Engine":
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.requests.append((request.headers.copy(), body))
        return await self.behaviour(request, body)

    async def stop(self):
        await self.runner.cleanup()


async def stream(request, parts, delay=0.0, abort=False, hold: asyncio.Event | None = None):
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for p in parts:
        if delay:
            await asyncio.sleep(delay)
        await resp.write(p)
        if hold is not None and p is parts[0]:
            await hold.wait()
    if abort:
        await asyncio.sleep(0.05)  # let the bytes leave before the connection dies
        request.transport.abort()
        return resp
    await resp.write_eof()
    return resp


METRICS_TOKEN = "mt-scrape"


BASE = {"allow_unauthenticated": True, "insecure_http": True, "access_log": False,
        "outlier": {"consecutive_errors": 1000},
        "metrics_tokens": [{"name": "prometheus", "sha256": hash_key(METRICS_TOKEN)}]}


SCRAPE = {"Authorization": f"Bearer {METRICS_TOKEN}"}


class Router:
    def __init__(self, endpoints, doc=None):
        d = dict(BASE)
        d.update(doc or {})
        self.settings = RouterSettings.from_config(d)
        self.table = EndpointTable(endpoints)
        self.app = build_app(self.settings, self.table)

    async def __aenter__(self):
        self.runner = web.AppRunner(self.app, **RUNNER_KWARGS)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self.http = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc):
        await self.http.close()
        await self.runner.cleanup()

    async def post(self, path="/v1/chat/completions", body=None, headers=None, raw=None):
        data = raw if raw is not None else json.dumps(body if body is not None else {"model": "m"}).encode()
        async with self.http.post(self.url + path, data=data, headers=headers or {}) as r:
            return r.status, r.headers.copy(), await r.read()

    async def chat_stream(self, headers=None, model="m"):
        return await self.post(body={"model": model, "stream": True, "messages": []}, headers=headers)

    async def metric(self, name, **labels) -> float:
        async with self.http.get(self.url + "/metrics", headers=SCRAPE) as r:
            text = await r.text()
        total = 0.0
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total

    @property
    def routing(self):
        return self.app[PROXY_KEY].routing


def eps(*engines, **kw):
    return [Endpoint(id=f"e{i}", model="m", url=e.url, **kw) for i, e in enumerate(engines)]


def events(body: bytes) -> list[bytes]:
    return [e + b"\n\n" for e in body.split(b"\n\n") if e]


def error_event(body: bytes) -> dict | None:
    for e in events(body):
        if e.startswith(b"data: {\"error\""):
            return json.loads(e[6:])["error"]
    return None
