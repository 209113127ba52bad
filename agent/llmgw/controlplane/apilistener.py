"""The admin API and agent stream's listener: one app, its middlewares in order, one bounded site.

Order matters: with ``ha`` the standby gate comes first (a standby answers
nothing itself), then the API's own admin check, then the body deadline,
so a refused request's body is never read.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Callable
from typing import Any

from aiohttp import web

from llmgw.clientbounds import (BodyTooSlow, ClientBounds, FactorySite, LimitedTCPSite, SourceGate, ThrottledLog,
                                head_timeout_kwargs, read_body)
from llmgw.controlplane.api import AGENTS, build_api
from llmgw.controlplane.badrequests import quiet_malformed_requests
from llmgw.controlplane.leader import Elector
from llmgw.controlplane.standby import stamp_leader_epoch, standby_gate
from llmgw.controlplane.state import ControlPlane
from llmgw.controlplane.tlssite import AnonymousDeadline, HandshakeLoggingSite
from llmgw.protocol import STREAM_PATH
from llmgw.tls.revocation import Revocations

log = logging.getLogger("llmgw.controlplane")

# Connections the kernel holds for the control plane before it accepts them.
# After a restart every agent of the fleet dials at once; aiohttp's default
# of 128 overflowed with a few hundred, and each dropped SYN costs its agent a
# retransmit (1 s, 3 s, 7 s...) and often its whole connect timeout.  The
# kernel caps it at net.core.somaxconn.
API_BACKLOG = 4096


def body_deadline(bounds: ClientBounds) -> Any:
    """A middleware reading each request body at no less than ``bounds``' minimum rate (408 otherwise).

    Admin requests carry a few kilobytes; without it a body held one byte
    short kept its connection, and its handler, forever.  The agent stream
    (a WebSocket) has no body and is left alone.
    """
    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.body_exists and request.path != STREAM_PATH:
            try:
                await read_body(request, request.content_length or request.client_max_size, bounds)
            except BodyTooSlow as e:
                resp = web.json_response({"error": str(e)}, status=408)
                resp.force_close()
                return resp
            except web.HTTPRequestEntityTooLarge:
                resp = web.json_response({"error": f"request body exceeds {request.client_max_size} bytes"},
                                         status=413)
                resp.force_close()  # the rest of the body stays unread
                return resp
        return await handler(request)

    return middleware


async def open_api(cp: ControlPlane, ssl_ctx: ssl.SSLContext | None, reload: Callable[[], tuple[bool, list[str]]],
                   watch_handler: Any, revocations: Revocations, elector: Elector | None) -> web.AppRunner:
    """Build the API (with ``elector``: the standby gate and the leader's term on watch answers) and listen."""
    settings = cp.settings
    clients = settings.api_clients
    bounds = clients.bounds()
    anonymous = AnonymousDeadline(clients.anonymous_timeout)
    watch = watch_handler if elector is None else stamp_leader_epoch(watch_handler, cp)
    app = build_api(cp, require_identity=ssl_ctx is not None, reload=reload, watch_handler=watch,
                    on_authenticated=anonymous.authenticated, revocations=revocations)
    if elector is not None:
        app.middlewares.insert(0, standby_gate(elector, lambda: cp.settings.lifecycle.max_registrations_per_second))
    app.middlewares.append(body_deadline(bounds))  # after the admin check: a refused body is never read
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, **head_timeout_kwargs(bounds))
    await runner.setup()
    quiet_malformed_requests()
    refused_log = ThrottledLog(log, "connection from %(host)s%(port)s refused: %(reason)s")

    def refused(peer: Any, reason: str) -> None:
        refused_log(peer, reason)
        cp.arriving("capped")  # most likely an agent dialling back: it holds the startup grace

    gate = SourceGate(bounds.max_connections_per_source, refused)
    if ssl_ctx is not None:
        # handshakes run by the site itself, so a refused client certificate is logged with its reason
        site: FactorySite = HandshakeLoggingSite(runner, settings.api_host, settings.api_port, ssl_context=ssl_ctx,
                                                 reuse_address=True, backlog=API_BACKLOG, gate=gate,
                                                 anonymous=anonymous, handshake_timeout=bounds.head_timeout,
                                                 timed_out=lambda: cp.arriving("timed_out"),
                                                 shed=app[AGENTS].shed_handshake,
                                                 dropped=app[AGENTS].handshake_waited_out)
    else:
        site = LimitedTCPSite(runner, settings.api_host, settings.api_port, reuse_address=True, backlog=API_BACKLOG,
                              gate=gate, handshake_timeout=bounds.head_timeout)
    await site.start()
    scheme = "https" if ssl_ctx is not None else "http"
    log.info("control plane listening on %s://%s:%d (agent stream at %s); pid %d",
             scheme, settings.api_host, settings.api_port, STREAM_PATH, os.getpid())
    return runner
