"""The in-process router of ``llmgw server``: built from ``server.yaml``'s ``router`` section, fed the endpoints.

Optional twice over: without ``llmgw.router`` installed the endpoints are
tracked but not served, and without a ``router`` section only the watch
API (for ``llmgw router`` processes) is offered.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from llmgw.clientbounds import LimitedTCPSite
from llmgw.controlplane.api import startup_grace_left
from llmgw.controlplane.endpointfeed import Published
from llmgw.controlplane.startup import StartupRefused
from llmgw.controlplane.state import ControlPlane
from llmgw.settings import ServerSettings

log = logging.getLogger("llmgw.controlplane")


class RouterHook:
    """The in-process router, when ``llmgw.router`` is available; endpoint updates go to its table."""

    def __init__(self, settings: ServerSettings, pending: Callable[[str], float] | None = None,
                 wake: Callable[..., object] | None = None):
        self.table: Any = None
        self.app: web.Application | None = None
        self.watch_handler: Any = None
        self.router_settings: Any = None
        self._endpoint_cls: Any = None
        self._runner_kwargs: dict[str, Any] = {}
        try:
            from llmgw.router.app import RUNNER_KWARGS, build_app, runner_kwargs
            from llmgw.router.endpoints import Endpoint, EndpointTable
            from llmgw.router.settings import RouterSettings
            from llmgw.router.watch import endpoints_watch_handler
        except ImportError as e:
            log.warning("router not available (%s): endpoints are tracked but not served", e)
            return
        self.table = EndpointTable()
        self._endpoint_cls = Endpoint
        self._runner_kwargs = dict(RUNNER_KWARGS)
        self.watch_handler = endpoints_watch_handler(self.table)
        if settings.router is not None:
            self.router_settings = RouterSettings.from_config(settings.router, source="server.yaml /router")
            if self.router_settings.api_keys_file is not None:
                raise StartupRefused("/router/api_keys_file: only a standalone router (llmgw router) reads a "
                                     "keys file; put the in-process router's keys in /router/api_keys")
            if self.router_settings.usage_log is not None:
                raise StartupRefused("/router/usage_log: only a standalone router (llmgw router) keeps a usage "
                                     "record; the in-process router's usage is in its llmgw_router_key_* metrics")
            if self.router_settings.engine_ca is None and settings.tls is not None:
                # engines serving TLS hold certificates of the fleet CA this control plane trusts
                self.router_settings = dataclasses.replace(self.router_settings, engine_ca=settings.tls.ca)
            from llmgw.router.serve import tls_errors

            problems = tls_errors(self.router_settings, "/router")
            if problems:
                raise StartupRefused("; ".join(str(p) for p in problems))
            if self.router_settings.workers > 1:
                log.warning("router.workers is %d: the in-process router runs one worker; run `llmgw router` "
                            "processes against the watch API to scale out", self.router_settings.workers)
            self.app = build_app(self.router_settings, self.table, pending=pending, wake=wake)
            self._runner_kwargs = runner_kwargs(self.router_settings)

    def outstanding(self) -> dict[str, int]:
        """Requests in flight per replica id through this router: the autoscaler's signal."""
        if self.app is None:
            return {}
        from llmgw.router.app import PROXY_KEY
        from llmgw.router.loadreport import in_flight

        return in_flight(self.app[PROXY_KEY].routing)

    def serve_route_keys(self, book: Any) -> None:
        """Offer ``book``'s route keys (``controlplane.routekeys``) on the watch to routers that ask."""
        if self.table is not None:
            from llmgw.router.watch import endpoints_watch_handler

            self.watch_handler = endpoints_watch_handler(self.table, route_keys=book)

    def update(self, published: Published) -> None:
        if self.table is None:
            return
        endpoints = []
        for e in published.endpoints:
            try:
                endpoints.append(self._endpoint_cls(**e))
            except ValueError as err:  # one replica's unusable URL must not hide every other endpoint
                log.warning("not routing to endpoint %s: %s", e.get("id", "?"), err)
        self.table.replace(endpoints, published.from_zero)

    async def start(self) -> web.AppRunner | None:
        if self.app is None:
            return None
        rs = self.router_settings
        runner = web.AppRunner(self.app, shutdown_timeout=rs.timeouts.shutdown_grace, **self._runner_kwargs)
        await runner.setup()
        from llmgw.router.serve import connection_gate, listener_ssl_context

        ssl_ctx = listener_ssl_context(rs)
        site = LimitedTCPSite(runner, rs.host, rs.port, backlog=rs.backlog, reuse_address=True, ssl_context=ssl_ctx,
                              gate=connection_gate(rs), handshake_timeout=rs.clients.head_timeout)
        await site.start()
        for address in site.addresses:  # port 0: say which one we got
            host, port = address[:2]
            log.info("router listening on %s://%s:%d", "https" if ssl_ctx else "http", host, port)
        return runner


def catalog_grace_left(cp: ControlPlane, model: str) -> float:
    """Startup grace left for a model the catalog serves (0 for one it does not, or after the grace).

    The in-process router starts with an empty table after every restart;
    until agents have re-registered, a catalog model it cannot route yet is
    answered 503 with Retry-After (as the watch API answers standalone
    routers), never 404 "does not exist".  A model the catalog lacks is
    still 404 at once.
    """
    left = startup_grace_left(cp)
    if left <= 0:
        return 0.0
    return left if any(model == m.served_name for m in cp.catalog.models.values()) else 0.0
