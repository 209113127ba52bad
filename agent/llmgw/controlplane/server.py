"""``llmgw server``: the control plane and, in the same process, the router.

One mutual-TLS listener carries the agent stream and the admin API; the
router listens on its own port and is fed the rank-0 endpoints of Ready
replicas whenever they change.  SIGHUP (or ``POST /v1/reload``) re-reads
``server.yaml``; a file that fails validation is refused, logged with
every error, and the running catalog stays in force.  The same reload
re-reads the revocation list (``tls.revoked``) and closes the streams of
nodes whose certificates it now names.

Identity is on by default: without a ``tls`` section the server refuses to
start unless ``insecure_no_tls`` is set, and then says so loudly at every
start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from llmgw.config import ConfigInvalid
from llmgw.controlplane.api import build_api, startup_grace_left
from llmgw.controlplane.badrequests import quiet_malformed_requests
from llmgw.controlplane.revocation import close_revoked_streams
from llmgw.controlplane.state import ControlPlane
from llmgw.controlplane.tlssite import HandshakeLoggingSite
from llmgw.eventloop import tune_gc
from llmgw.memtrim import trim_periodically
from llmgw.settings import ServerSettings, load_server_settings
from llmgw.tls.revocation import RevocationError, Revocations

log = logging.getLogger("llmgw.controlplane")


class StartupRefused(Exception):
    """The server will not start; the message says why and what to change."""


def tls_context(settings: ServerSettings):
    """The API's SSL context, or None in (explicitly) insecure mode; ``StartupRefused`` otherwise."""
    if settings.tls is None:
        if not settings.insecure_no_tls:
            raise StartupRefused("no tls section in server.yaml: the agent stream and the API require mutual TLS "
                                 "(set insecure_no_tls: true only for development)")
        for line in ("*** insecure_no_tls is set: the API and agent stream run WITHOUT TLS ***",
                     "*** node identities are NOT checked; any client can register as any node ***",
                     "*** development only: never run a fleet like this ***"):
            log.warning(line)
        return None
    if settings.insecure_no_tls:
        log.warning("insecure_no_tls is set but a tls section is present: TLS and identity stay on")
    from llmgw.tls import TLSConfigError, server_context
    from llmgw.tls.files import private_mode_problem

    key = Path(settings.tls.key)
    if key.is_file():
        problem = private_mode_problem(key)
        if problem:
            raise StartupRefused(f"tls.key: {problem}")
    try:
        # Client certificates are optional at the handshake so an operator can
        # use a bearer token; a certificate that is presented is still verified,
        # and the stream refuses any connection without a node certificate.
        return server_context(settings.tls.ca, settings.tls.cert, settings.tls.key, require_client_cert=False)
    except TLSConfigError as e:
        raise StartupRefused(f"tls: {e}") from e


class RouterHook:
    """The in-process router, when ``llmgw.router`` is available; endpoint updates go to its table."""

    def __init__(self, settings: ServerSettings, pending: Callable[[str], float] | None = None):
        self.table: Any = None
        self.app: web.Application | None = None
        self.watch_handler: Any = None
        self.router_settings: Any = None
        self._endpoint_cls: Any = None
        self._runner_kwargs: dict[str, Any] = {}
        try:
            from llmgw.router.app import RUNNER_KWARGS, build_app
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
            from llmgw.router.serve import tls_errors

            problems = tls_errors(self.router_settings, "/router")
            if problems:
                raise StartupRefused("; ".join(str(p) for p in problems))
            if self.router_settings.workers > 1:
                log.warning("router.workers is %d: the in-process router runs one worker; run `llmgw router` "
                            "processes against the watch API to scale out", self.router_settings.workers)
            self.app = build_app(self.router_settings, self.table, pending=pending)

    def update(self, eps: list[dict[str, Any]]) -> None:
        if self.table is None:
            return
        endpoints = []
        for e in eps:
            try:
                endpoints.append(self._endpoint_cls(**e))
            except ValueError as err:  # one replica's unusable URL must not hide every other endpoint
                log.warning("not routing to endpoint %s: %s", e.get("id", "?"), err)
        self.table.replace(endpoints)

    async def start(self) -> web.AppRunner | None:
        if self.app is None:
            return None
        rs = self.router_settings
        runner = web.AppRunner(self.app, shutdown_timeout=rs.timeouts.shutdown_grace, **self._runner_kwargs)
        await runner.setup()
        from llmgw.router.serve import listener_ssl_context

        ssl_ctx = listener_ssl_context(rs)
        site = web.TCPSite(runner, rs.host, rs.port, backlog=rs.backlog, reuse_address=True, ssl_context=ssl_ctx)
        await site.start()
        for sock in getattr(site._server, "sockets", None) or ():  # port 0: say which one we got
            host, port = sock.getsockname()[:2]
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


def revocations_for(settings: ServerSettings) -> Revocations:
    """The revocation list ``tls.revoked`` names (empty when none); ``StartupRefused`` when it cannot be read."""
    try:
        return Revocations(settings.tls.revoked if settings.tls is not None else None)
    except RevocationError as e:
        raise StartupRefused(f"tls.revoked: {e}") from e


def reload_revocations(cp: ControlPlane, revocations: Revocations, path: str | None) -> None:
    """Re-read the revocation list (``path``: ``tls.revoked`` of the reloaded file) and close revoked streams.

    Runs whether or not the rest of ``server.yaml`` reloads: revoking a key
    must not wait on an unrelated typo in the catalog.
    """
    if path != revocations.path:
        if path is None:
            log.warning("reload: tls.revoked removed; the list %s stays in force until the next restart",
                        revocations.path)
        else:
            log.info("reload: tls.revoked is now %s (was %s)", path, revocations.path)
            revocations.path = path
    revocations.reload()
    close_revoked_streams(cp, revocations)


def reloader(cp: ControlPlane, path: str | None,
             revocations: Revocations | None = None) -> Callable[[], tuple[bool, list[str]]]:
    def reload() -> tuple[bool, list[str]]:
        if path is None:
            return False, ["started without a config file: nothing to reload"]
        try:
            new = load_server_settings(path)
        except ConfigInvalid as e:
            errors = [str(x) for x in e.errors]
            log.error("reload refused, the running catalog stays in force:\n%s", e)
            if revocations is not None:
                reload_revocations(cp, revocations, revocations.path)
            return False, errors
        if revocations is not None:
            reload_revocations(cp, revocations, new.tls.revoked if new.tls is not None else None)
        cp.apply_settings(new, path)
        return True, []
    return reload


# Connections the kernel holds for the control plane before it accepts them.
# After a restart every agent of the fleet dials at once; aiohttp's default
# of 128 overflowed with a few hundred, and each dropped SYN costs its agent a
# retransmit (1 s, 3 s, 7 s...) and often its whole connect timeout.  The
# kernel caps it at net.core.somaxconn.
API_BACKLOG = 4096


async def serve(settings: ServerSettings, config_path: str | None = None,
                stop: asyncio.Event | None = None) -> None:
    """Run until ``stop`` is set (or SIGTERM/SIGINT)."""
    ssl_ctx = tls_context(settings)
    revocations = revocations_for(settings)
    cp = ControlPlane(settings, config_path)
    router = RouterHook(settings, pending=lambda model: catalog_grace_left(cp, model))
    cp.on_endpoints(router.update)
    reload = reloader(cp, config_path, revocations)
    app = build_api(cp, require_identity=ssl_ctx is not None, reload=reload, watch_handler=router.watch_handler,
                    revocations=revocations)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    quiet_malformed_requests()
    if ssl_ctx is not None:
        # handshakes run by the site itself, so a refused client certificate is logged with its reason
        site: web.TCPSite = HandshakeLoggingSite(runner, settings.api_host, settings.api_port, ssl_context=ssl_ctx,
                                                 reuse_address=True, backlog=API_BACKLOG)
    else:
        site = web.TCPSite(runner, settings.api_host, settings.api_port, reuse_address=True, backlog=API_BACKLOG)
    await site.start()
    scheme = "https" if ssl_ctx is not None else "http"
    log.info("control plane listening on %s://%s:%d (agent stream at /v1/agent/stream); pid %d",
             scheme, settings.api_host, settings.api_port, os.getpid())
    router_runner = await router.start()

    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: (log.info("SIGHUP: reloading %s", config_path), reload()))
    lc = settings.lifecycle
    log.info("lifecycle: heartbeat %gs, keepalive %gs, unreachable after %gs, lost after %gs, startup grace %gs",
             lc.heartbeat_interval, lc.keepalive_interval, lc.unreachable_after, lc.lost_after, lc.startup_grace)
    tune_gc()  # thousands of streams hold many objects: freeze what start-up built, collect less often
    ticker = asyncio.create_task(cp.run(), name="reconcile loop")
    trimmer = asyncio.create_task(trim_periodically(), name="heap trim")
    try:
        await stop.wait()
    finally:
        log.info("stopping; engines keep running and agents reconnect to the next control plane")
        for task in (ticker, trimmer):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        for s in list(cp.sessions.values()):
            s.close("control plane shutting down")
        if router_runner is not None:
            await router_runner.cleanup()
        await runner.cleanup()


def run_server(settings: ServerSettings, config_path: str | None = None) -> int:
    """Blocking entry point; returns the process exit status."""
    try:
        # asyncio's own loop, not uvloop: the stream's TLS handshakes run through
        # loop.start_tls on a transport paused at accept (tlssite), and uvloop starts
        # reading after connection_made whatever the protocol asked, so a ClientHello
        # that arrived at once was read and lost and its handshake hung for 30 s.
        asyncio.run(serve(settings, config_path))
    except StartupRefused as e:
        log.error("refusing to start: %s", e)
        return 2
    except ConfigInvalid as e:
        log.error("refusing to start:\n%s", e)
        return 2
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", settings.api_host, settings.api_port, e.strerror or e)
        return 1
    return 0
