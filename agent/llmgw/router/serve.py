"""Running the router standalone: one or N worker processes on one port.

Each worker binds the port with SO_REUSEPORT and builds its own app,
endpoint table and connection pools; the kernel spreads new connections
across them.  SO_REUSEPORT would also let any other process of the same
user that sets it (vLLM does, a second router would) bind the port and take
a share of the clients without a word, so the supervisor first binds the
port plainly and lets go: a port someone already holds fails the start,
naming it.  A single worker does not set it at all, so nothing can join it
later either.  One Python process saturates around one core of SSE relaying,
so workers are how the router scales.  The parent only supervises: it
restarts a worker that died, and on SIGTERM asks every worker to finish its
in-flight requests (up to ``timeouts.shutdown_grace``) before exiting.  On
SIGHUP it has every worker re-read the revocation list
(``control_plane.revoked``), which each checks at its next handshake with
the control plane, and its API keys and their limits (``limitsreload``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import gc
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import ssl
import sys
import tempfile
import time
from typing import Any, Callable

from aiohttp import web

from llmgw.clientbounds import LimitedSockSite, SourceGate, ThrottledLog
from llmgw.config import ConfigError, ConfigInvalid
from llmgw.eventloop import run_loop, tune_gc
from llmgw.tls.context import TLSConfigError, control_plane_context, public_server_context
from llmgw.tls.revocation import RevocationError, Revocations, load_revocations
from llmgw.tls.files import private_mode_problem

from .app import PROXY_KEY, build_app, runner_kwargs
from .endpoints import EndpointTable
from .kvindex import KVIndex
from .settings import ControlPlane, RouterSettings
from .allowance import Allowance
from .ejectreport import report_ejections
from .loadreport import report_load
from .holdqueue import ControlPlaneWaker
from .usagelog import UsageLog
from .limitsreload import reload_keys, reloaded_doc
from .watch import watch_endpoints

log = logging.getLogger("llmgw.router")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"
# How long a router fed by the watch waits for its first endpoint set before it
# serves anyway: a restarted router that answered at once would refuse every
# model ("not found") until the watch answered, while a router beside it serves.
FIRST_ENDPOINTS_WAIT = 30.0


def configure_logging(level: str = "info") -> None:
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        root.addHandler(handler)
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def tls_errors(settings: RouterSettings, where: str = "") -> list[ConfigError]:
    """The listener's certificate and key: present, the key private, the pair loadable.

    ``where`` prefixes the pointers (``/router`` inside server.yaml).
    """
    tls = settings.tls
    if tls is None:
        return []
    errors = file_errors(tls, ("cert", "key"), f"{where}/tls")
    if not errors:
        try:
            public_server_context(tls.cert, tls.key)
        except TLSConfigError as e:
            errors.append(ConfigError(f"{where}/tls", str(e)))
    return errors


def file_errors(section: object, fields: tuple[str, ...], where: str) -> list[ConfigError]:
    """Each of ``section``'s file fields present, and its ``key`` private, at ``where/field``."""
    errors = []
    for field in fields:
        path = getattr(section, field)
        if not os.path.isfile(path):
            errors.append(ConfigError(f"{where}/{field}", f"no such file: {path}"))
        elif field == "key":
            problem = private_mode_problem(path)
            if problem:
                errors.append(ConfigError(f"{where}/key", problem))
    return errors


def listener_ssl_context(settings: RouterSettings) -> ssl.SSLContext | None:
    """HTTPS for clients, or None where insecure_http was chosen (the settings allow nothing else)."""
    if settings.tls is None:
        log.warning("insecure_http: serving plain HTTP; API keys and prompts cross the network readable")
        return None
    return public_server_context(settings.tls.cert, settings.tls.key)


def standalone_errors(settings: RouterSettings) -> list[ConfigError]:
    """What a router without an in-process control plane additionally needs."""
    errors = tls_errors(settings)
    if settings.static_endpoints is None and settings.control_plane is None:
        errors.append(ConfigError("", "a standalone router needs static_endpoints or control_plane"))
    if settings.control_plane is not None:
        errors += file_errors(settings.control_plane, ("ca", "cert", "key"), "/control_plane")
        if settings.control_plane.revoked is not None:
            try:
                load_revocations(settings.control_plane.revoked)
            except RevocationError as e:
                errors.append(ConfigError("/control_plane/revoked", str(e)))
    return errors


def control_plane_ssl_context(cp: ControlPlane, revocations: Revocations | None = None) -> ssl.SSLContext:
    """Client context for the watch API and ejection reports: the control plane verified against
    the fleet CA (and nothing else), holding the ``server`` role and not revoked; our certificate
    presented only then."""
    return control_plane_context(cp.ca, cp.cert, cp.key, revocations=revocations)


def connection_gate(settings: RouterSettings) -> SourceGate:
    """The per-source connection cap of the client listener, its refusals logged once a minute per address."""
    return SourceGate(settings.clients.max_connections_per_source,
                      ThrottledLog(log, "connection from %(host)s%(port)s refused: %(reason)s"))


class PortInUse(Exception):
    """The router's port is held by another process (it would otherwise share the clients silently)."""


def listen_socket(host: str, port: int, backlog: int, listen: bool = True, share: bool = True) -> socket.socket:
    """A bound (and listening) socket; ``share``: with SO_REUSEPORT, for workers of one router."""
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    family, addr = info[0], info[4]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if share:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise PortInUse(f"cannot listen on {host or '*'}:{port}: another process holds the port "
                                f"(ss -ltnp 'sport = :{port}' names it)") from None
            raise
        if listen:
            sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


async def serve_worker(settings: RouterSettings, sock: socket.socket, on_ready: Callable[[], None],
                       source: str | None = None) -> None:
    """One worker: app + table (+ watch client) on an already bound socket, until SIGTERM/SIGINT.

    SIGHUP re-reads the revocation list (with a control plane) and, when the
    config file ``source`` is known, the API keys and their limits.
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    table = EndpointTable(settings.static_endpoints or ())
    watch_task = None
    allowance: Allowance | None = None
    kv_index: KVIndex | None = None  # route keys for cache-aware models, fed by the watch
    background = []
    hangups: list[Callable[[], Any]] = []  # what SIGHUP re-reads, added to as the parts start
    loop.add_signal_handler(signal.SIGHUP, lambda: [f() for f in hangups])
    if settings.control_plane is not None:
        revocations = Revocations(settings.control_plane.revoked)
        hangups.append(revocations.reload)  # checked at each handshake
        ctx = control_plane_ssl_context(settings.control_plane, revocations)
        cp_url = settings.control_plane.url
        cp_urls = settings.control_plane.urls or (cp_url,)
        background.append(lambda routing: report_ejections(cp_urls, ctx, routing))
        background.append(lambda routing: report_load(cp_urls, ctx, routing))
        if settings.allowance.mode == "shared":  # limited keys spend slices leased from the control plane
            allowance = Allowance(settings.control_plane.urls or (cp_url,), ctx, settings.allowance.timeout,
                                  settings.allowance.on_outage)
            background.append(lambda routing: allowance.run_returns())
        if settings.balancing.cache_aware.models:
            kv_index = KVIndex(stale_after=settings.balancing.cache_aware.stale_after)
        watch_task = asyncio.create_task(watch_endpoints(settings.control_plane.urls or settings.control_plane.url, ctx,
                                                         None, table, kv_index=kv_index),
                                         name="llmgw-endpoint-watch")
        # Connections meanwhile wait in the listen backlog; they are not refused.
        rev, _ = await table.wait_changed(table.revision, FIRST_ENDPOINTS_WAIT)
        if rev == 0:
            log.warning("no endpoint set from the control plane after %gs; serving with none until it answers",
                        FIRST_ENDPOINTS_WAIT)
    waker = None
    if settings.control_plane is not None:  # a model whose endpoints all sleep: ask for its wake
        waker = ControlPlaneWaker(settings.control_plane.urls or (settings.control_plane.url,), ctx)
    app = build_app(settings, table, background=background, kv_index=kv_index, wake=waker)
    app[PROXY_KEY].limits_gate.allowance = allowance
    if settings.usage_log is not None:  # written each minute by a background job, and at the end
        usage_log = UsageLog(settings.usage_log)
        app[PROXY_KEY].limits_gate.usage_log = usage_log
        background.append(lambda routing: usage_log.run())
    if source is not None:
        in_force = [settings]

        def keys() -> None:
            in_force[0] = reload_keys(app[PROXY_KEY], source, in_force[0])

        hangups.append(keys)
    runner = web.AppRunner(app, shutdown_timeout=settings.timeouts.shutdown_grace, **runner_kwargs(settings))
    await runner.setup()
    site = LimitedSockSite(runner, sock, backlog=settings.backlog, ssl_context=listener_ssl_context(settings),
                           gate=connection_gate(settings), handshake_timeout=settings.clients.head_timeout)
    await site.start()
    tune_gc()
    on_ready()
    await stop.wait()
    log.info("stopping: finishing in-flight requests (up to %gs)", settings.timeouts.shutdown_grace)
    if watch_task is not None:
        watch_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch_task
    await runner.cleanup()
    if waker is not None:
        await waker.close()


def _announce(host: str, port: int, workers: int, https: bool) -> None:
    scheme = "https" if https else "http"
    line = f"llmgw router listening on {scheme}://{host}:{port} ({workers} worker{'s' if workers > 1 else ''})"
    log.info(line)
    print(line, flush=True)


def _die_with_parent() -> None:
    """A worker must not outlive its supervisor (it would hold the port forever)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _worker_entry(doc: Any, source: str, port: int, index: int, ready: Any, log_level: str) -> None:
    _die_with_parent()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until serve_worker handles it: a reload must not kill it
    configure_logging(log_level)
    settings = RouterSettings.from_config(doc, source)
    sock = listen_socket(settings.host, port, settings.backlog)
    run_loop(serve_worker(settings, sock, lambda: ready.put((index, os.getpid())), source))


def serve(settings: RouterSettings, doc: Any, source: str, workers: int | None = None,
          log_level: str = "info") -> int:
    """Run until SIGTERM/SIGINT; returns the process exit status."""
    errors = standalone_errors(settings)
    if errors:
        raise ConfigInvalid(source, errors)
    n = workers or settings.workers
    if n == 1:
        sock = listen_socket(settings.host, settings.port, settings.backlog, share=False)
        port = sock.getsockname()[1]
        run_loop(serve_worker(settings, sock, lambda: _announce(settings.host, port, 1, settings.tls is not None),
                              source))
        return 0
    return _Supervisor(settings, doc, source, n, log_level).run()


def tracker_stop() -> Callable[[], None] | None:
    """multiprocessing's ``resource_tracker._resource_tracker._stop``, or None where it has none.

    Both names are private (there in Python 3.8 to 3.13); without them the
    tracker outlives the router and is left to systemd (``_reap_resource_tracker``).
    tests/unit/test_private_api_guards.py fails, naming them, on a Python
    where they are gone."""
    from multiprocessing import resource_tracker

    return getattr(getattr(resource_tracker, "_resource_tracker", None), "_stop", None)


class _Supervisor:
    def __init__(self, settings: RouterSettings, doc: Any, source: str, workers: int, log_level: str) -> None:
        self.s = settings
        self.doc = doc
        self.source = source
        self.n = workers
        self.log_level = log_level
        self.stopping = False
        self.ctx = multiprocessing.get_context("spawn")
        self.ready = self.ctx.Queue()
        self.procs: dict[int, Any] = {}
        self.port = settings.port

    def _start(self, index: int) -> None:
        p = self.ctx.Process(target=_worker_entry, name=f"llmgw-router-worker-{index}",
                             args=(self.doc, self.source, self.port, index, self.ready, self.log_level))
        p.start()
        self.procs[index] = p

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.stopping = True

    def _on_hangup(self, signum: int, frame: Any) -> None:
        """SIGHUP (``systemctl reload``): every worker re-reads what it reloads (revocation list, API keys).

        The keys are taken into the document a restarted worker starts from too,
        so a worker that dies after a reload does not come back with the old keys.
        """
        self.doc = reloaded_doc(self.doc, self.source)
        for p in self.procs.values():
            if p.pid is not None and p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGHUP)

    def run(self) -> int:
        metrics_dir = tempfile.mkdtemp(prefix="llmgw-router-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        old[signal.SIGHUP] = signal.signal(signal.SIGHUP, self._on_hangup)
        reserve = None
        try:
            if self.port == 0:
                # Pick the port once, for every worker; holding it bound (not listening)
                # keeps anyone else from taking it until the workers have it.
                reserve = listen_socket(self.s.host, 0, 1, listen=False)
                self.port = reserve.getsockname()[1]
            else:  # held by someone else (with SO_REUSEPORT or not): fail here, not share it
                listen_socket(self.s.host, self.port, 1, listen=False, share=False).close()
            for i in range(self.n):
                self._start(i)
            if not self._await_ready():
                self._stop_all()
                return 1
            if reserve is not None:
                reserve.close()
                reserve = None
            _announce(self.s.host, self.port, self.n, self.s.tls is not None)
            self._supervise()
            self._stop_all()
            return 0
        finally:
            if reserve is not None:
                reserve.close()
            for s, h in old.items():
                signal.signal(s, h)
            shutil.rmtree(metrics_dir, ignore_errors=True)
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
            self._reap_resource_tracker()

    def _reap_resource_tracker(self) -> None:
        """Exit with nothing of the router left running, the resource tracker included.

        The spawn start method runs multiprocessing's resource tracker beside the
        workers, and on its own it exits only after this process has.  systemd
        (KillMode=mixed) then finds it in the unit and SIGKILLs it, and where it
        cannot see the unit's cgroup empty (cgroup v1 inside a container) it waits
        out TimeoutStopSec (shutdown_grace + 15 s) before a restart goes on.  The
        ready queue goes first: its semaphores unregister when it is collected, or
        the tracker would report them leaked.
        """
        self.ready.close()
        self.ready.join_thread()
        self.ready = None
        self.procs.clear()  # their arguments hold the queue too
        gc.collect()
        stop = tracker_stop()
        if stop is not None:
            with contextlib.suppress(Exception):
                stop()

    def _await_ready(self) -> bool:
        pending = set(self.procs)
        deadline = time.monotonic() + 120
        while pending and not self.stopping:
            try:
                index, _pid = self.ready.get(timeout=0.2)
                pending.discard(index)
            except Exception:  # queue.Empty
                pass
            for i in list(pending):
                if not self.procs[i].is_alive():
                    log.error("worker %d exited with status %s during startup", i, self.procs[i].exitcode)
                    return False
            if time.monotonic() > deadline:
                log.error("workers %s not ready after 120s", sorted(pending))
                return False
        return not pending

    def _supervise(self) -> None:
        from prometheus_client import multiprocess

        restarts: dict[int, int] = {}
        due: dict[int, float] = {}
        while not self.stopping:
            sentinels = {p.sentinel: i for i, p in self.procs.items() if p.is_alive() or p.exitcode is None}
            multiprocessing.connection.wait(list(sentinels), timeout=0.5)
            with contextlib.suppress(Exception):
                while True:
                    self.ready.get_nowait()
            now = time.monotonic()
            for i, p in list(self.procs.items()):
                if p.exitcode is not None and i not in due and not self.stopping:
                    with contextlib.suppress(Exception):
                        multiprocess.mark_process_dead(p.pid)
                    restarts[i] = restarts.get(i, 0) + 1
                    delay = min(30.0, 0.5 * 2 ** (restarts[i] - 1))
                    log.error("worker %d (pid %d) exited with status %s; restarting in %.1fs",
                              i, p.pid, p.exitcode, delay)
                    due[i] = now + delay
            for i, t in list(due.items()):
                if now >= t and not self.stopping:
                    del due[i]
                    self._start(i)

    def _stop_all(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.s.timeouts.shutdown_grace + 5
        for p in self.procs.values():
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                log.error("worker pid %d did not stop in time; killing it", p.pid)
                p.kill()
                p.join(5)
