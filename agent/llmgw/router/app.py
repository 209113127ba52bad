"""The router's aiohttp application: OpenAI paths, /healthz and /metrics only.

There is deliberately no admin surface on this port: endpoints arrive from
the control plane (in process, or over its authenticated watch API), never
from router clients.  ``/metrics`` names every model and replica, so it
takes a bearer token of ``metrics_tokens`` (Prometheus'
``authorization.credentials_file``); only an open router
(``allow_unauthenticated``) without tokens leaves it open.

Run it with ``web.AppRunner(app, **runner_kwargs(cfg))``: handler
cancellation lets a client that hangs up abort the engine request it
caused, and the keep-alive timer is the request-head deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import time
from typing import AsyncIterator, Awaitable, Callable, Sequence

from aiohttp import web

from llmgw.clientbounds import head_timeout_kwargs

from .admission import Admission, Caps
from .balancing import make_balancer, make_parity_check
from .kvindex import KVIndex
from .endpoints import EndpointTable
from .metrics import CONTENT_TYPE, RouterMetrics
from .models import OPENAI_POST_PATHS
from .holdqueue import HoldQueue
from .proxy import Proxy
from .runtime import Routing, run_housekeeping
from .settings import RouterSettings

__all__ = ["build_app", "RouterSettings", "RUNNER_KWARGS", "PROXY_KEY", "ADMISSION_KEY", "runner_kwargs"]

RUNNER_KWARGS = {"access_log": None, "handler_cancellation": True}
PROXY_KEY: web.AppKey[Proxy] = web.AppKey("llmgw_router_proxy", Proxy)
ADMISSION_KEY: web.AppKey[Admission] = web.AppKey("llmgw_router_admission", Admission)


def runner_kwargs(cfg: RouterSettings) -> dict:
    """``web.AppRunner`` arguments: ``RUNNER_KWARGS`` and the request-head deadline."""
    return {**RUNNER_KWARGS, **head_timeout_kwargs(cfg.clients.bounds())}


def metrics_allowed(cfg: RouterSettings, authorization: str | None) -> bool:
    """A ``metrics_tokens`` bearer token; anything on an open router that configured none."""
    if not cfg.metrics_tokens:
        return cfg.allow_unauthenticated
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return False
    digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()
    return any(hmac.compare_digest(digest, t.sha256) for t in cfg.metrics_tokens)


def build_app(cfg: RouterSettings, table: EndpointTable, metrics: RouterMetrics | None = None,
              pending: Callable[[str], float] | None = None,
              background: Sequence[Callable[[Routing], Awaitable[None]]] = (),
              kv_index: KVIndex | None = None, wake: Callable[..., object] | None = None) -> web.Application:
    """An application routing by ``model`` to the endpoints in ``table``.

    ``table`` is read on every request (one integer comparison when it did
    not change), so callers just ``table.replace(...)`` when replicas change.
    ``pending(model)``: seconds until the table can be trusted to list
    ``model`` (0 once it can); while positive, a request for a model the
    table lacks gets 503 with Retry-After instead of 404.
    """
    metrics = metrics or RouterMetrics()
    scorer = make_balancer(cfg.balancing, kv_index, metrics.registry)  # kv_index: route keys from the watch
    parity = make_parity_check(scorer, cfg.balancing.cache_aware.parity_timeout, metrics.registry)
    routing = Routing(table, cfg, metrics, scorer)
    proxy = Proxy(cfg, routing, metrics, pending)
    proxy.holds = HoldQueue(routing, cfg.hold, wake)  # ``wake(model)``: ask the control plane to wake it
    c = cfg.clients
    admission = Admission(Caps(c.max_requests_per_key, c.max_requests_per_source, c.max_body_bytes_per_key,
                               c.max_body_bytes_per_source), c.bounds(), proxy.keys, cfg.limits.max_body_bytes,
                          metrics)
    app = web.Application(client_max_size=cfg.limits.max_body_bytes)
    app[PROXY_KEY] = proxy
    app[ADMISSION_KEY] = admission
    handle = admission.wrap(proxy.handle)
    for path in OPENAI_POST_PATHS:
        app.router.add_post(path, handle)
    app.router.add_get("/v1/models", proxy.list_models)
    app.router.add_get("/v1/models/{model}", proxy.get_model)

    async def healthz(request: web.Request) -> web.Response:
        routing.sync()
        doc = {"status": "ok", "revision": routing.revision, "endpoints": len(routing.runtimes()),
               "models": len(routing.models())}
        if kv_index is not None:  # cache-aware routing: how much the index holds, and how current it is
            doc["route_keys"] = {"revision": kv_index.revision, "replicas": kv_index.sizes(),
                                 "age_s": None if kv_index.synced_at is None
                                 else round(time.monotonic() - kv_index.synced_at, 1)}
        if parity is not None:  # models tokenized with their own tokenizer: do the engines agree?
            doc["tokenizer_parity"] = parity.status()
        return web.json_response(doc)

    async def metrics_handler(request: web.Request) -> web.Response:
        if not metrics_allowed(cfg, request.headers.get("Authorization")):
            return web.Response(status=401, text="/metrics needs a bearer token of metrics_tokens\n",
                                headers={"WWW-Authenticate": 'Bearer realm="llmgw-metrics"'})
        body = await asyncio.get_running_loop().run_in_executor(None, metrics.render)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_route("*", "/{tail:.*}", proxy.fallback)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(run_housekeeping(routing), name="llmgw-router-housekeeping")]
        tasks += [asyncio.create_task(job(routing)) for job in background]
        if parity is not None:
            tasks.append(asyncio.create_task(parity.run(routing), name="llmgw-router-parity"))
        yield
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await proxy.close()  # abandoned attempts still awaiting their engine's verdict
        await routing.close()

    app.cleanup_ctx.append(lifecycle)
    return app
