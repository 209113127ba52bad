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

``serve`` composes; the parts are modules of their own: what is checked
before starting (``startup``), the API's listener (``apilistener``), the
in-process router (``routerhook``), reloading (``reload``) and, with
``ha``, leadership (``leadership``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from llmgw.config import ConfigInvalid
from llmgw.controlplane.apilistener import open_api
from llmgw.controlplane.grants import GrantKeys
from llmgw.controlplane.grantsecret import GrantSecretError, grant_keys
from llmgw.controlplane.leadership import LeaderHooks, ha_store, make_elector
from llmgw.controlplane.loophold import install as install_loop_hold
from llmgw.controlplane.reload import reloader
from llmgw.controlplane.routerhook import RouterHook, catalog_grace_left
from llmgw.controlplane.standby import DEPOSED_EXIT
from llmgw.controlplane.startup import StartupRefused, revocations_for, tls_context
from llmgw.controlplane.state import ControlPlane
from llmgw.controlplane.store import StoreError, open_store
from llmgw.eventloop import tune_gc
from llmgw.memtrim import trim_periodically
from llmgw.settings import ServerSettings

# ``StartupRefused``, ``tls_context`` and ``RouterHook`` were defined here; their homes are above.
__all__ = ["Deposed", "RouterHook", "StartupRefused", "run_server", "serve", "tls_context"]

log = logging.getLogger("llmgw.controlplane")


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
    hooks = None if elector is None else LeaderHooks(cp, elector, stop)
    router = RouterHook(settings, pending=lambda model: catalog_grace_left(cp, model), wake=cp.wake_model)
    cp.on_endpoints(router.update)
    if router.app is not None:
        cp.outstanding = router.outstanding
    router.serve_route_keys(cp.route_keys)
    reload = reloader(cp, config_path, revocations)
    runner = await open_api(cp, ssl_ctx, reload, router.watch_handler, revocations, elector)
    router_runner = await router.start()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: (log.info("SIGHUP: reloading %s", config_path), reload()))
    install_loop_hold(loop)  # tests only: armed by LLMGW_TEST_HOLD_LOOP
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
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2):
            loop.remove_signal_handler(sig)
        for s in list(cp.sessions.values()):
            s.close("control plane shutting down")
        if router_runner is not None:
            await router_runner.cleanup()
        await runner.cleanup()
    if hooks is not None and hooks.deposed:
        raise Deposed()


class Deposed(Exception):
    """This process led and no longer does; it exits so that it starts again as a standby."""


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
