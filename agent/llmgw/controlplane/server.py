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
import dataclasses
import logging
import os
import signal
import socket
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from llmgw.clientbounds import (BodyTooSlow, ClientBounds, FactorySite, LimitedTCPSite, SourceGate, ThrottledLog,
                                head_timeout_kwargs, read_body)
from llmgw.config import ConfigInvalid
from llmgw.controlplane.api import build_api, startup_grace_left
from llmgw.controlplane.badrequests import quiet_malformed_requests
from llmgw.controlplane.etcd import AsyncEtcd, BlockingEtcd
from llmgw.controlplane.etcd import tls_context as etcd_tls
from llmgw.controlplane.grants import GrantKeys
from llmgw.controlplane.grantsecret import GrantSecretError, grant_keys
from llmgw.controlplane.leader import Elector
from llmgw.controlplane.revocation import close_revoked_streams
from llmgw.controlplane.standby import DEPOSED_EXIT, stamp_leader_epoch, standby_gate
from llmgw.controlplane.state import ControlPlane
from llmgw.controlplane.store import ControlPlaneStore, EtcdBackend, StoreError, open_store
from llmgw.controlplane.tlssite import AnonymousDeadline, HandshakeLoggingSite
from llmgw.eventloop import tune_gc
from llmgw.memtrim import trim_periodically
from llmgw.protocol import STREAM_PATH
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
            self.app = build_app(self.router_settings, self.table, pending=pending)
            self._runner_kwargs = runner_kwargs(self.router_settings)

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


async def serve(settings: ServerSettings, config_path: str | None = None,
                stop: asyncio.Event | None = None) -> None:
    """Run until ``stop`` is set (or SIGTERM/SIGINT)."""
    ssl_ctx = tls_context(settings)
    stop = stop or asyncio.Event()
    elector = make_elector(settings) if settings.ha is not None else None
    try:
        store = open_store(settings.state_dir) if elector is None else ha_store(settings, elector)
    except StoreError as e:
        raise StartupRefused(f"{'ha' if elector else 'state_dir'}: {e}") from e
    try:
        # With ha the secret is the store's, shared by every control plane and read on taking the lead:
        # a standby signs and verifies nothing until then.
        keys = grant_keys(settings.state_dir) if elector is None else GrantKeys.fresh()
    except GrantSecretError as e:
        raise StartupRefused(f"state_dir: {e}") from e
    revocations = revocations_for(settings)
    cp = ControlPlane(settings, config_path, keys=keys, store=store)
    deposed = False
    if elector is not None:
        cp.authority = lambda: elector.is_leader

        def leadership(leading: bool, epoch: int) -> None:
            nonlocal deposed
            if leading:
                try:
                    cp.take_over(epoch)
                except (StoreError, GrantSecretError) as e:  # cannot read what the last leader wrote: do not lead blind
                    log.error("cannot read the store on taking over: %s; giving the lead up", e)
                    asyncio.get_running_loop().create_task(elector.resign())
                return
            # Never a standby in place: the book is from a term that ended. Exit; the service manager
            # starts a fresh standby.
            log.error("no longer the leader: exiting (status %d) to start again as a standby", DEPOSED_EXIT)
            deposed = True
            stop.set()

        elector.on_change = leadership
    router = RouterHook(settings, pending=lambda model: catalog_grace_left(cp, model))
    cp.on_endpoints(router.update)
    reload = reloader(cp, config_path, revocations)
    clients = settings.api_clients
    bounds = clients.bounds()
    anonymous = AnonymousDeadline(clients.anonymous_timeout)
    watch = router.watch_handler if elector is None else stamp_leader_epoch(router.watch_handler, cp)
    app = build_api(cp, require_identity=ssl_ctx is not None, reload=reload, watch_handler=watch,
                    on_authenticated=anonymous.authenticated, revocations=revocations)
    if elector is not None:
        app.middlewares.insert(0, standby_gate(elector))
    app.middlewares.append(body_deadline(bounds))  # after the admin check: a refused body is never read
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, **head_timeout_kwargs(bounds))
    await runner.setup()
    quiet_malformed_requests()
    gate = SourceGate(bounds.max_connections_per_source, ThrottledLog(log, "connection from %(host)s%(port)s refused: %(reason)s"))
    if ssl_ctx is not None:
        # handshakes run by the site itself, so a refused client certificate is logged with its reason
        site: FactorySite = HandshakeLoggingSite(runner, settings.api_host, settings.api_port, ssl_context=ssl_ctx,
                                                 reuse_address=True, backlog=API_BACKLOG, gate=gate,
                                                 anonymous=anonymous, handshake_timeout=bounds.head_timeout)
    else:
        site = LimitedTCPSite(runner, settings.api_host, settings.api_port, reuse_address=True, backlog=API_BACKLOG,
                              gate=gate, handshake_timeout=bounds.head_timeout)
    await site.start()
    scheme = "https" if ssl_ctx is not None else "http"
    log.info("control plane listening on %s://%s:%d (agent stream at %s); pid %d",
             scheme, settings.api_host, settings.api_port, STREAM_PATH, os.getpid())
    router_runner = await router.start()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: (log.info("SIGHUP: reloading %s", config_path), reload()))
    lc = settings.lifecycle
    log.info("lifecycle: heartbeat %gs, keepalive %gs, unreachable after %gs, lost after %gs, startup grace %gs",
             lc.heartbeat_interval, lc.keepalive_interval, lc.unreachable_after, lc.lost_after, lc.startup_grace)
    tune_gc()  # thousands of streams hold many objects: freeze what start-up built, collect less often
    ticker = asyncio.create_task(cp.run(), name="reconcile loop")
    trimmer = asyncio.create_task(trim_periodically(), name="heap trim")
    campaign = None if elector is None else asyncio.create_task(elector.run(stop), name="leader election")
    try:
        await stop.wait()
    finally:
        log.info("stopping; engines keep running and agents reconnect to the next control plane")
        cp.stopping = True  # from here a new stream is refused, and one registering now is closed at once
        for task in (ticker, trimmer, campaign):
            if task is None:
                continue
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if elector is not None:  # deposed too: the lease it stepped down from may still hold the key
            await elector.resign()  # a standby takes over now, not a lease later
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        for s in list(cp.sessions.values()):
            s.close("control plane shutting down")
        if router_runner is not None:
            await router_runner.cleanup()
        await runner.cleanup()
    if deposed:
        raise Deposed()


class Deposed(Exception):
    """This process led and no longer does; it exits so that it starts again as a standby."""


def make_elector(settings: ServerSettings) -> Elector:
    ha = settings.ha
    assert ha is not None
    try:
        tls = etcd_tls(ha.ca, ha.cert, ha.key)
    except (OSError, ssl.SSLError) as e:
        raise StartupRefused(f"ha.etcd: cannot load its TLS files: {e}") from e
    url = ha.advertise_url or f"{'https' if settings.tls else 'http'}://{settings.api_host}:{settings.api_port}"
    return Elector(AsyncEtcd(ha.endpoints, tls, timeout=max(0.5, ha.renew_interval)), ha.prefix,
                   ha.name or socket.gethostname(), url, ha.lease_ttl, ha.renew_interval)


def ha_store(settings: ServerSettings, elector: Elector) -> ControlPlaneStore:
    """Intent and epochs in etcd, shared by the control planes; every write fenced on leading."""
    ha = settings.ha
    assert ha is not None
    if settings.state_dir is not None:
        log.info("ha: cordons, drains and the epoch are kept in etcd, not in state_dir %s", settings.state_dir)
    client = BlockingEtcd(ha.endpoints, etcd_tls(ha.ca, ha.cert, ha.key), timeout=max(0.5, ha.renew_interval))
    return ControlPlaneStore(EtcdBackend(client, ha.prefix, fence=elector.fence))


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
    except Deposed:
        return DEPOSED_EXIT
    except ConfigInvalid as e:
        log.error("refusing to start:\n%s", e)
        return 2
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", settings.api_host, settings.api_port, e.strerror or e)
        return 1
    return 0
