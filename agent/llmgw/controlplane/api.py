"""The control plane's HTTP API, on the same mutual-TLS port as the agent stream.

Nothing but ``/healthz`` is open.  An operator proves itself with an admin
certificate or an admin bearer token (only its sha256 is configured).  A
node certificate is refused here even alongside a valid token: a node that
could drive the admin API could place work on every other node.

Without TLS (``insecure_no_tls``) there are no client certificates, so a
token is the only way in; with no ``api.admin_tokens`` configured every
admin request (``/metrics`` and the router watch included) is refused with
401 and told so, never let through.

The router watch (``/v1/router/endpoints``) also admits a router
certificate, and only a router certificate is answered with the engines'
keys: an operator may look at the endpoint set, but the keys go to the one
role that needs them to route.  Routers report what they ejected on
``/v1/router/ejections`` (``ejections_api``), which admits only them.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from llmgw.clientbounds import ThrottledLog
from llmgw.controlplane import views
from llmgw.controlplane.agentservice import AgentService, request_identity
from llmgw.controlplane.allowance_api import AllowanceAPI
from llmgw.controlplane.autoscale_wake_api import WakeAPI
from llmgw.controlplane.ejections_api import EjectionsAPI
from llmgw.controlplane.listquery import NODE_STATES, REPLICA_STATES, QueryError, parse_list_query
from llmgw.controlplane.metrics import CONTENT_TYPE, registry_for, render
from llmgw.controlplane.openapi import OPENAPI_PATH, document
from llmgw.controlplane.requestcount import AdminRequests
from llmgw.controlplane.revocation import install, unless_revoked
from llmgw.controlplane.routerload_api import LoadAPI
from llmgw.controlplane.state import ControlPlane
from llmgw.controlplane.store import StoreError
from llmgw.protocol import (ALLOWANCE_PATH, EJECTIONS_PATH, LOAD_PATH, SCHEDULABLE, STREAM_PATH, WAKE_PATH, WATCH_PATH,
                            Cordon)
from llmgw.router.watch import REVEAL_KEYS
from llmgw.tls import IdentityError, Revocations, RevokedError, check_admin_identity, check_router_identity

log = logging.getLogger("llmgw.controlplane.api")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
OPEN_PATHS = frozenset({"/healthz"})
AGENTS = web.AppKey("agents", AgentService)  # the agent streams' service: its admission also gates handshakes
NO_TOKENS = ("the admin API is closed: without TLS client certificates (insecure_no_tls) it needs an admin "
             "bearer token, and none is configured; add api.admin_tokens to server.yaml (name and sha256 of "
             "the token) and reload or restart")


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class AdminAuth:
    """Decides whether a request comes from an operator."""

    def __init__(self, cp: ControlPlane, require_identity: bool):
        self.cp = cp
        self.require_identity = require_identity

    def router(self, request: web.Request) -> str | None:
        """Who, when the request carries a router certificate (the watch's own caller); else None."""
        name = self.router_name(request)
        return None if name is None else f"router certificate {name!r}"

    def router_name(self, request: web.Request) -> str | None:
        """The router certificate's name, or None when the request carries none."""
        if not self.require_identity:
            return None
        try:
            identity = request_identity(request)
            check_router_identity(identity)
        except IdentityError:
            return None
        return identity.name

    def check(self, request: web.Request) -> tuple[int, str]:
        """(0, who) when allowed, else (HTTP status, reason)."""
        if self.require_identity:
            try:
                identity = request_identity(request)
            except RevokedError as e:
                return 403, e.reason  # a revoked certificate is refused whatever else comes with it
            except IdentityError:
                identity = None  # no certificate: a token may still do
            if identity is not None:
                try:
                    check_admin_identity(identity)
                except IdentityError as e:
                    return 403, e.reason
                return 0, f"admin certificate {identity.name!r}"
        header = request.headers.get("Authorization", "")
        tokens = self.cp.settings.admin_tokens
        if not self.require_identity and not tokens:
            return 401, NO_TOKENS
        if header:
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                return 401, "Authorization must be 'Bearer <admin token>'"
            digest = token_digest(token.strip())
            for name, want in tokens:
                if hmac.compare_digest(digest, want):
                    return 0, f"admin token {name!r}"
            return 403, "unknown admin token"
        if not self.require_identity:
            return 401, "an admin bearer token is required (Authorization: Bearer <token>)"
        return 401, "an admin certificate or an admin bearer token is required"


@web.middleware
async def json_refusals(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own 404 and 405 (no such route, a method a route lacks) in the API's error shape.

    They were text/plain, the one refusal a client of the API could not read
    as ``{"error": ...}``.  Runs outside the admin check, so a caller without
    credentials learns nothing about which routes exist.
    """
    try:
        return await handler(request)
    except web.HTTPMethodNotAllowed as e:
        allowed = ", ".join(sorted(e.allowed_methods))
        return web.json_response({"error": f"{request.method} is not allowed on {request.path}; allowed: {allowed}"},
                                 status=405, headers={"Allow": allowed})
    except web.HTTPNotFound:
        return web.json_response({"error": f"no route {request.path} (the routes: GET /openapi.json)"}, status=404)


WATCH_HOLD = 25.0  # seconds a watch poll may wait for the startup grace (routers read for 45 s)


def startup_grace_left(cp: ControlPlane) -> float:
    """Seconds of the startup grace left (0 after it): until then the endpoint set is still filling up."""
    return cp.timers.grace_left(cp.clock(), cp.settings.lifecycle)


def grace_aware_watch(cp: ControlPlane, handler: Handler, stopping: asyncio.Event | None = None) -> Handler:
    """The endpoint watch, held back while the control plane is in its startup grace.

    A control plane that has just started knows no replica until agents
    report, so its endpoint set starts empty and only fills up.  Answering
    a standalone router with that set would empty the router's table and
    fail traffic to engines that never stopped serving.  During the grace a
    poll waits (up to ``WATCH_HOLD``) and is then answered 503, which the
    router treats as "keep what you have and ask again".

    Once ``stopping`` is set, a poll still held (in the grace, or waiting
    for a change for up to 30 s) is answered 503 at once: the server's stop
    waits for every request in flight, so held polls would otherwise hold a
    restart back for as long as they wait, the API refusing agents meanwhile.
    """

    async def held(request: web.Request) -> web.StreamResponse:
        # the grace may grow while the poll waits (agents still arriving hold it): wait again, up to WATCH_HOLD
        loop = asyncio.get_running_loop()
        until = loop.time() + WATCH_HOLD
        left = startup_grace_left(cp)
        while left > 0 and loop.time() < until:
            await asyncio.sleep(min(left, until - loop.time()))
            left = startup_grace_left(cp)
        if left > 0:
            return web.json_response({"error": f"control plane starting: the endpoint set is not known until "
                                               f"agents have reported ({left:.0f}s of startup grace left)"},
                                     status=503, headers={"Retry-After": str(int(left) + 1)})
        return await handler(request)

    if stopping is None:
        return held

    async def released_on_stop(request: web.Request) -> web.StreamResponse:
        poll = asyncio.ensure_future(held(request))
        stop = asyncio.ensure_future(stopping.wait())
        try:
            await asyncio.wait((poll, stop), return_when=asyncio.FIRST_COMPLETED)
            if poll.done():
                return poll.result()
        finally:
            stop.cancel()
            poll.cancel()  # nothing when it is done; still held: the answer is the one below
        return web.json_response({"error": "control plane stopping: ask again in a moment"},
                                 status=503, headers={"Retry-After": "1"})

    return released_on_stop


def build_api(cp: ControlPlane, *, require_identity: bool = True,
              reload: Callable[[], tuple[bool, list[str]]] | None = None,
              watch_handler: Handler | None = None,
              on_authenticated: Callable[[Any], None] | None = None,
              revocations: Revocations | None = None) -> web.Application:
    """The aiohttp application: agent stream, admin API, metrics, health.

    ``on_authenticated(transport)``: told of each connection that proved an
    admin token (one without a client certificate is closed unless it does).
    Refusals are logged once a minute per peer address and reason: a client
    repeating a refused request must not flood the log.
    ``revocations``: the certificates refused although the CA signed them,
    checked on every request (``controlplane.revocation``).
    """
    auth = AdminAuth(cp, require_identity)
    if not require_identity and not cp.settings.admin_tokens:
        for line in ("*** no TLS client certificates and no api.admin_tokens: the admin API is CLOSED ***",
                     "*** every admin request (ctl, /metrics, the router watch) is refused with 401 ***",
                     "*** configure api.admin_tokens in server.yaml to use it ***"):
            log.error(line)
    agents = AgentService(cp, require_identity=require_identity)
    registry = registry_for(cp)
    admin_requests = AdminRequests()
    registry.register(admin_requests)
    refused = ThrottledLog(log, "refused %(request)s from %(host)s: %(reason)s")

    @web.middleware
    async def admin_only(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS or request.path in (STREAM_PATH, EJECTIONS_PATH, ALLOWANCE_PATH, WAKE_PATH,
                                                          LOAD_PATH):
            # the stream checks node identity itself; ejections, allowances, wakes and load a router's
            return await handler(request)
        router = auth.router_name(request) if request.path == WATCH_PATH else None
        if router is not None:
            request[REVEAL_KEYS] = True
            cp.router_watching(router)
            answer = await unless_revoked(request, handler(request), lambda: auth.router_name(request) is not None)
            if answer is None or auth.router_name(request) is None:  # revoked while the poll was held: no keys
                log.warning("refused %s %s from %s: router certificate %r revoked during the poll",
                            request.method, request.path, request.remote, router)
                return web.json_response({"error": f"router certificate {router!r} is revoked"}, status=403)
            return answer
        status, who = auth.check(request)
        if status:
            refused(request.remote, who, request=f"{request.method} {request.path[:200]}")
            headers = {"WWW-Authenticate": 'Bearer realm="llmgw"'} if status == 401 else None
            return web.json_response({"error": who}, status=status, headers=headers)
        if on_authenticated is not None:
            on_authenticated(request.transport)
        admin_requests.count(request)
        return await handler(request)

    app = web.Application(middlewares=[json_refusals, admin_only], client_max_size=1 << 20)
    app[AGENTS] = agents
    app.on_shutdown.append(agents.shutdown)
    if revocations is not None:
        install(app, revocations)

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def nodes(request: web.Request) -> web.Response:
        try:
            query = parse_list_query(query_of(request), "/v1/nodes", NODE_STATES)
        except QueryError as e:
            return web.json_response({"error": str(e)}, status=400)
        return web.json_response(views.nodes_view(cp, query))

    async def node(request: web.Request) -> web.Response:
        node_id = request.match_info["node_id"]
        out = views.node_or_none(cp, node_id)
        if out is None:
            return web.json_response({"error": f"no node {node_id!r} has registered; known: "
                                               f"{views.some_of(cp.nodes)}"}, status=404)
        return web.json_response(out)

    async def replica(request: web.Request) -> web.Response:
        rid = request.match_info["replica_id"]
        out = views.replica_or_none(cp, rid)
        if out is None:
            return web.json_response({"error": f"no replica {rid!r} (GET /v1/replicas lists them)"}, status=404)
        return web.json_response(out)

    async def summary(request: web.Request) -> web.Response:
        return web.json_response(views.summary_view(cp))

    async def replicas(request: web.Request) -> web.Response:
        try:
            query = parse_list_query(query_of(request), "/v1/replicas", REPLICA_STATES)
        except QueryError as e:
            return web.json_response({"error": str(e)}, status=400)
        return web.json_response(views.replicas_view(cp, query))

    async def catalog(request: web.Request) -> web.Response:
        return web.json_response(views.catalog_view(cp))

    async def explain(request: web.Request) -> web.Response:
        model = request.match_info["model"]
        out = views.explain_view(cp, model)
        if out is None:
            known = ", ".join(sorted(cp.catalog.models)) or "none"
            return web.json_response({"error": f"model {model!r} is not in the catalog; known: {known}"}, status=404)
        return web.json_response(out)

    async def drain(request: web.Request) -> web.Response:
        rid = request.match_info["replica_id"]
        try:
            cp.drain(rid)
        except KeyError:
            return web.json_response({"error": f"no replica {rid!r}"}, status=404)
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=409)
        except StoreError as e:
            log.error("%s: cannot record the drain: %s", rid, e)
            return web.json_response({"error": f"cannot record it, nothing changed: {e}"}, status=503)
        r = cp.reconciler.book.replicas[rid]
        return web.json_response({"replica": views.replica_view(cp, r, cp.clock())}, status=202)

    def node_action(state: str | None) -> Handler:
        async def act(request: web.Request) -> web.Response:
            node_id = request.match_info["node_id"]
            try:
                before = cp.cordon(node_id, state)
            except KeyError:
                return web.json_response({"error": f"no node {node_id!r} has registered; known: "
                                                   f"{views.some_of(cp.nodes)}"}, status=404)
            except StoreError as e:
                log.error("%s: cannot record %s: %s", node_id, state or "uncordon", e)
                return web.json_response({"error": f"cannot record it, nothing changed: {e}"}, status=503)
            log.info("%s %s by %s (was %s)", node_id, state or "uncordoned", auth.check(request)[1],
                     before or SCHEDULABLE)
            node = (views.node_cordon_view(cp, node_id) if node_id in cp.nodes
                    else {"node_id": node_id, "cordon": state})  # lifted before its node came back
            return web.json_response({"node": node, "was": before}, status=202 if state == Cordon.DRAINING else 200)
        return act

    async def do_reload(request: web.Request) -> web.Response:
        if reload is None:
            return web.json_response({"error": "this control plane was started without a config file"}, status=409)
        ok, errors = reload()
        body: dict[str, Any] = {"ok": ok, "errors": errors}
        if ok:
            body["catalog"] = views.catalog_view(cp)
        return web.json_response(body, status=200 if ok else 400)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=render(registry), headers={"Content-Type": CONTENT_TYPE})

    app.router.add_get("/healthz", healthz)
    app.router.add_get(STREAM_PATH, agents.handle)
    app.router.add_get("/v1/nodes", nodes)
    app.router.add_get("/v1/nodes/{node_id}", node)
    app.router.add_get("/v1/summary", summary)
    app.router.add_get("/v1/replicas", replicas)
    app.router.add_get("/v1/replicas/{replica_id}", replica)
    app.router.add_get("/v1/catalog", catalog)
    app.router.add_get("/v1/explain/{model}", explain)
    app.router.add_post("/v1/replicas/{replica_id}/drain", drain)
    app.router.add_post("/v1/nodes/{node_id}/cordon", node_action(Cordon.CORDONED.value))
    app.router.add_post("/v1/nodes/{node_id}/drain", node_action(Cordon.DRAINING.value))
    app.router.add_post("/v1/nodes/{node_id}/uncordon", node_action(None))
    app.router.add_post("/v1/reload", do_reload)
    app.router.add_post(EJECTIONS_PATH, EjectionsAPI(cp, auth.router_name).handle)
    app.router.add_post(ALLOWANCE_PATH, AllowanceAPI(cp, auth.router_name).handle)
    app.router.add_post(WAKE_PATH, WakeAPI(cp, auth.router_name).handle)
    app.router.add_post(LOAD_PATH, LoadAPI(cp, auth.router_name).handle)
    app.router.add_get("/metrics", metrics)
    if watch_handler is not None:
        stopping = asyncio.Event()

        async def release_watchers(_app: web.Application) -> None:
            stopping.set()

        app.on_shutdown.append(release_watchers)
        app.router.add_get(WATCH_PATH, grace_aware_watch(cp, watch_handler, stopping))

    spec: list[bytes] = []

    async def openapi(request: web.Request) -> web.Response:
        # Behind the admin check like the rest: it names no secret, but only an
        # operator needs the map of what an operator can do.
        if not spec:
            spec.append(json.dumps(document(registered_routes(app))).encode())
        return web.Response(body=spec[0], content_type="application/json")

    app.router.add_get(OPENAPI_PATH, openapi)
    return app


def query_of(request: web.Request) -> dict[str, list[str]]:
    """Each query parameter's values, in order."""
    return {k: request.query.getall(k) for k in request.query}


def registered_routes(app: web.Application) -> set[tuple[str, str]]:
    """(method, path) of every route ``app`` answers (HEAD, which aiohttp adds to each GET, left out)."""
    return {(r.method, r.resource.canonical) for r in app.router.routes()
            if r.resource is not None and r.method != "HEAD"}
