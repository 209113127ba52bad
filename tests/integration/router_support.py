"""Fixtures for the router's real-process tests (this module holds no tests).

- ``RouterProcess``: ``python -m llmgw.router --config FILE`` as a child process;
  its port is read from the line it prints once every worker listens.
- ``Blackhole``: a socket that accepts connections and never answers.
- ``CountingServer``: answers every request with a fixed HTTP status and counts them,
  so a test can compare what reached the engines with what the router claims.
- ``SSEServer``: answers every request with a scripted event stream (comments, role-only
  chunks, [DONE] where a real engine would not put it).
- ``ControlPlane``: the watch API (``endpoints_watch_handler``) on mutual TLS with a
  throw-away fleet CA, in a background thread, for watch-mode routers.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support.polling import until
from tests.support.ports import closed_port

HOST = "127.0.0.1"
_LISTENING = re.compile(r"llmgw router listening on (https?)://([^:]+):(\d+)")


def metric_sum(families: Iterable[Any], name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``, over parsed metric families
    (``prometheus_client.parser.text_string_to_metric_families``): a router's ``/metrics``."""
    return sum((s.value for fam in families for s in fam.samples
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())), 0.0)


class RouterProcess:
    def __init__(self, config: dict, workers: int | None = None, tmp: Path | None = None,
                 env: dict | None = None, ca: str | None = None) -> None:
        # ca: the CA file clients verify an https router against
        self.ssl = None
        if ca is not None:
            import ssl
            self.ssl = ssl.create_default_context(cafile=ca)
        self.dir = Path(tmp or tempfile.mkdtemp(prefix="llmgw-router-test-"))
        self.config_path = self.dir / "router.yaml"
        cfg = {"listen": {"host": HOST, "port": 0}, **config}
        self.config_path.write_text(yaml.safe_dump(cfg))
        self.log_path = self.dir / f"router-{time.monotonic_ns()}.log"
        argv = [sys.executable, "-m", "llmgw.router", "--config", str(self.config_path)]
        if workers is not None:
            argv += ["--workers", str(workers)]
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        full_env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=full_env, start_new_session=True)
        self.port = 0
        try:
            m = until(self._listening, "the router to listen", 120, interval=0.05)
        except AssertionError:
            self.stop()
            raise AssertionError(f"router did not start:\n{self.output()}") from None
        self.scheme, self.port = m.group(1), int(m.group(3))

    def _listening(self):
        if self.proc.poll() is not None:
            raise AssertionError(f"router exited with {self.proc.returncode}:\n{self.output()}")
        return _LISTENING.search(self.output())

    def output(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    @property
    def url(self) -> str:
        return f"{self.scheme}://{HOST}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    metrics_token: str | None = None  # one of the router's metrics_tokens, where it has any

    def get(self, path: str, timeout: float = 30.0, headers: dict | None = None) -> bytes:
        req = urllib.request.Request(self.url + path, headers=headers or {})
        with urllib.request.urlopen(req, timeout=timeout, context=self.ssl) as r:
            return r.read()

    def metrics(self) -> list:
        headers = {"Authorization": f"Bearer {self.metrics_token}"} if self.metrics_token else None
        return list(text_string_to_metric_families(self.get("/metrics", headers=headers).decode()))

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples called ``name`` whose labels include ``labels``."""
        return metric_sum(self.metrics(), name, **labels)

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=timeout)
        return self.proc.returncode

    def __enter__(self) -> "RouterProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _ThreadServer:
    """A loopback TCP server whose connections are served by ``handle(conn)`` on threads."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((HOST, 0))
        self.sock.listen(512)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{HOST}:{self.port}"
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.handle, args=(conn,), daemon=True).start()

    def handle(self, conn: socket.socket) -> None:  # pragma: no cover - overridden
        conn.close()

    def close(self) -> None:
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Blackhole(_ThreadServer):
    """Accepts, reads whatever arrives, never answers; holds connections until released."""

    def __init__(self) -> None:
        self.held: list[socket.socket] = []
        self.requests = 0
        super().__init__()

    def handle(self, conn: socket.socket) -> None:
        with self._lock:
            self.held.append(conn)
        conn.settimeout(None)
        try:
            while conn.recv(65536):
                with self._lock:
                    self.requests += 1
        except OSError:
            pass

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self.held)

    def release(self) -> None:
        """Reset every held connection, as a backend that finally gives up would."""
        with self._lock:
            held, self.held = self.held, []
        for c in held:
            try:
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                # shutdown wakes the thread blocked in recv (a bare close from here would not)
                c.shutdown(socket.SHUT_RDWR)
                c.close()
            except OSError:
                pass

    def close(self) -> None:
        self.release()
        super().close()


def read_request(conn: socket.socket, buf: bytes) -> bytes | None:
    """Read one request (head and Content-Length body) from ``conn``, ``buf`` holding what was read
    before; returns the bytes after it, or None when the peer closed first."""
    while b"\r\n\r\n" not in buf:
        data = conn.recv(65536)
        if not data:
            return None
        buf += data
    head, _, rest = buf.partition(b"\r\n\r\n")
    m = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    need = int(m.group(1)) if m else 0
    while len(rest) < need:
        data = conn.recv(65536)
        if not data:
            return None
        rest += data
    return rest[need:]


class CountingServer(_ThreadServer):
    """HTTP/1.1 server answering every request ``status`` with an OpenAI error body; counts requests."""

    def __init__(self, status: int = 500) -> None:
        self.status = status
        self.count = 0
        super().__init__()

    def handle(self, conn: socket.socket) -> None:
        buf = b""
        body = b'{"error":{"message":"injected failure","type":"InternalServerError","param":null,"code":500}}'
        with conn:
            while True:
                try:
                    buf = read_request(conn, buf)
                except OSError:
                    return
                if buf is None:
                    return
                with self._lock:
                    self.count += 1
                conn.sendall(b"HTTP/1.1 %d Failed\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                             % (self.status, len(body), body))


class SSEServer(_ThreadServer):
    """HTTP/1.1 server answering every request with a scripted ``text/event-stream`` body.

    ``script`` is a list of ``(delay_s, bytes)``: each piece is sent as one chunk after its delay;
    the body then ends (chunked terminator) and the connection is closed.  Counts requests.
    """

    def __init__(self, script: list[tuple[float, bytes]]) -> None:
        self.script = script
        self.count = 0
        super().__init__()

    def handle(self, conn: socket.socket) -> None:
        buf = b""
        with conn:
            try:
                if read_request(conn, buf) is None:
                    return
                with self._lock:
                    self.count += 1
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
                for delay, piece in self.script:
                    if delay:
                        time.sleep(delay)
                    conn.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                conn.sendall(b"0\r\n\r\n")
            except OSError:  # the router hung up
                return


class ControlPlane:
    """The real watch handler on a real mTLS listener, driven from the test thread."""

    def __init__(self, tmp: Path) -> None:
        from llmgw.router.endpoints import EndpointTable
        from llmgw.tls.ca import init_ca
        from llmgw.tls.files import write_pair
        from llmgw.tls.issue import issue_admin, issue_server

        ca = init_ca(tmp / "ca")
        self.ca_file = str(tmp / "ca" / "ca.crt")
        self.server_cert, self.server_key = map(str, write_pair(tmp / "cp", *issue_server(ca, [HOST])))
        self.client_cert, self.client_key = map(str, write_pair(tmp / "router", *issue_admin(ca, "router")))
        self.table = EndpointTable()
        self.port = closed_port()
        self.url = f"https://{HOST}:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._runner = None
        self._thread.start()
        self._started.wait(30)
        self.start()

    def router_config(self) -> dict:
        return {"url": self.url, "ca": self.ca_file, "cert": self.client_cert, "key": self.client_key}

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._started.set)
        self._loop.run_forever()

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(60)

    def start(self) -> None:
        from aiohttp import web

        from llmgw.protocol import WATCH_PATH
        from llmgw.router.watch import endpoints_watch_handler
        from llmgw.tls.context import server_context

        async def up():
            app = web.Application()
            app.router.add_get(WATCH_PATH, endpoints_watch_handler(self.table, wait_s=1.0))
            runner = web.AppRunner(app, shutdown_timeout=2)
            await runner.setup()
            ctx = server_context(self.ca_file, self.server_cert, self.server_key)
            await web.TCPSite(runner, HOST, self.port, ssl_context=ctx, reuse_address=True).start()
            return runner

        self._runner = self._call(up())

    def stop_listening(self) -> None:
        if self._runner is not None:
            self._call(self._runner.cleanup())
            self._runner = None

    def close(self) -> None:
        self.stop_listening()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def router_doc(endpoints: list[dict] | None = None, **overrides: Any) -> dict:
    """A router config for tests: open (no keys) and plain HTTP unless overridden (``tls=...``)."""
    doc: dict[str, Any] = {"allow_unauthenticated": True, "access_log": True}
    if "tls" not in overrides:
        doc["insecure_http"] = True
    if endpoints is not None:
        doc["static_endpoints"] = endpoints
    for k, v in overrides.items():
        doc[k] = v
    return doc


def openai_client(router: RouterProcess, key: str = "unused", timeout: float = 120.0):
    import httpx
    import openai
    # max_retries=0: the SDK's own retries would hide what the router did
    http = httpx.Client(verify=router.ssl, timeout=timeout) if router.ssl is not None else None
    return openai.OpenAI(base_url=router.base_url, api_key=key, max_retries=0, timeout=timeout, http_client=http)


def start_sims(n: int, model: str = "m", env: dict | None = None, envs: list[dict] | None = None):
    """Start ``n`` simulators in parallel and wait until all are healthy."""
    from simproc import start_sim

    sims = [start_sim(model=model, env=(envs[i] if envs else env), wait=False) for i in range(n)]
    try:
        for s in sims:
            s.wait_healthy(120)
    except BaseException:
        for s in sims:
            s.stop()
        raise
    return sims
