"""A weights server for the fetcher's tests (this module holds no tests).

``WeightsServer`` is a real HTTP/1.1 server (aiohttp.web on 127.0.0.1, in a
background thread with its own loop) that serves byte strings with the
parts of HTTP a resumable download depends on: a strong ETag and
Last-Modified, ``Range: bytes=N-`` answered with 206 and Content-Range,
``If-Range`` honoured (a changed ETag gets the whole new body), 416 past
the end.  Each file also carries switches for the ways real servers and
networks misbehave: ignoring Range, a wrong Content-Range, 416 for
everything, no Content-Length (chunked), a stall after N bytes, a trickle,
and a pause at an exact byte offset so a test can kill the client there.
Every GET is counted (HEADs apart) and every byte sent is added up per file.

Given an ``ssl.SSLContext`` the same server speaks HTTPS (``tls_server_context``
issues it a certificate from a CA made for the test), so a test can drive the
fetcher's TLS path against the same switches.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import ssl
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from aiohttp import web

LAST_MODIFIED = "Wed, 01 Jan 2025 00:00:00 GMT"


@dataclass
class Answer:
    """One GET's response as the server wrote it: bytes handed to the socket, and whether its handler ended."""

    sent: int = 0
    finished: bool = False  # written whole, or abandoned when the client went away


@dataclass
class Served:
    data: bytes
    etag: str | None = None  # default: a strong ETag from the content
    last_modified: str | None = LAST_MODIFIED
    ignore_range: bool = False  # answer 200 with the whole body to a range request
    wrong_content_range: bool = False  # 206 starting one byte after what was asked
    always_416: bool = False  # 416 to every range request
    no_length: bool = False  # chunked, no Content-Length (and no ranges)
    chunked: bool = False  # chunked, no Content-Length, but Range honoured (206 + Content-Range)
    stall_after: int | None = None  # go silent (connection held open) once a response reaches this offset
    stall_times: int | None = None  # only the first N responses stall (None: all)
    trickle: tuple[int, float] | None = None  # (bytes per write, seconds between writes)
    chunk: int = 1 << 16
    # Called (in the server thread) when a response reaches this absolute
    # offset; the response then waits for ``release`` before going on.
    pause_at: int | None = None
    on_pause: Callable[[], None] | None = None
    release: threading.Event = field(default_factory=threading.Event)
    # Lockstep: write number k waits until ``allow(name, k + 1)`` (a test calls it as its client
    # reports); after ``lockstep`` writes, or once ``hold(name)`` is called, the response holds
    # the connection silent.
    lockstep: int | None = None
    allowed: int = 0
    held: bool = False
    wake: asyncio.Event | None = None
    gets: int = 0  # GETs only: a HEAD (the control plane measuring the file) is no download
    heads: int = 0
    sent: int = 0
    requests: list[dict[str, str]] = field(default_factory=list)
    answers: list["Answer"] = field(default_factory=list)  # one per GET, in order

    def current_etag(self) -> str:
        return self.etag if self.etag is not None else '"' + hashlib.sha256(self.data).hexdigest()[:16] + '"'


class WeightsServer:
    def __init__(self, ssl_context: ssl.SSLContext | None = None) -> None:
        self.ssl_context = ssl_context
        self.files: dict[str, Served] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self.port = 0

    # ----------------------------------------------------------------- control
    def add(self, name: str, data: bytes, **switches) -> Served:
        s = Served(data, **switches)
        self.files[name] = s
        return s

    def allow(self, name: str, writes: int) -> None:
        """Thread-safe: let a lockstep response make its first ``writes`` writes."""
        s = self.files[name]

        def set_() -> None:
            s.allowed = max(s.allowed, writes)
            if s.wake is not None:
                s.wake.set()

        assert self.loop is not None
        self.loop.call_soon_threadsafe(set_)

    def hold(self, name: str) -> None:
        """Thread-safe: a lockstep response stops writing (and holds the connection silent)."""
        s = self.files[name]

        def set_() -> None:
            s.held = True
            if s.wake is not None:
                s.wake.set()

        assert self.loop is not None
        self.loop.call_soon_threadsafe(set_)

    def url(self, name: str) -> str:
        scheme = "https" if self.ssl_context is not None else "http"
        return f"{scheme}://127.0.0.1:{self.port}/{name}"

    def __enter__(self) -> "WeightsServer":
        self._thread = threading.Thread(target=self._main, name="weights-server", daemon=True)
        self._thread.start()
        if not self._started.wait(30):
            raise RuntimeError("weights server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        for s in self.files.values():
            s.release.set()
        if self.loop is not None and self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(30)

    def _main(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        app = web.Application()
        app.router.add_get("/{name:.+}", self._handle)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=self.ssl_context)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._started.set()
        await self._stop.wait()
        await runner.cleanup()

    # ---------------------------------------------------------------- handling
    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._respond(request)
        except ConnectionResetError:  # the client went away (killed, gave up): its business
            raise asyncio.CancelledError() from None

    async def _respond(self, request: web.Request) -> web.StreamResponse:
        s = self.files.get(request.match_info["name"])
        if s is None:
            raise web.HTTPNotFound()
        size = len(s.data)
        if request.method == "HEAD":
            s.heads += 1
            return web.Response(headers={"Accept-Ranges": "bytes", "ETag": s.current_etag(),
                                         "Content-Length": str(size)})
        s.gets += 1
        s.requests.append(dict(request.headers))
        answer = Answer()
        s.answers.append(answer)
        try:
            return await self._send(request, s, size, answer)
        finally:
            answer.finished = True

    async def _send(self, request: web.Request, s: "Served", size: int, answer: "Answer") -> web.StreamResponse:
        headers = {"Accept-Ranges": "bytes", "ETag": s.current_etag()}
        if s.last_modified:
            headers["Last-Modified"] = s.last_modified
        start, status = 0, 200
        rng = request.headers.get("Range")
        if rng and not s.ignore_range and not s.no_length:
            if_range = request.headers.get("If-Range")
            if if_range is None or if_range in (s.current_etag(), s.last_modified):
                first = int(rng.removeprefix("bytes=").split("-")[0])
                if s.always_416 or first >= size:
                    return web.Response(status=416, headers={"Content-Range": f"bytes */{size}"})
                start, status = first, 206
        resp = web.StreamResponse(status=status, headers=headers)
        if status == 206:
            shown = start + 1 if s.wrong_content_range else start
            resp.headers["Content-Range"] = f"bytes {shown}-{size - 1}/{size}"
        if s.no_length or s.chunked:
            resp.enable_chunked_encoding()
        else:
            resp.content_length = size - start
        await resp.prepare(request)
        stalls = s.stall_after is not None and (s.stall_times is None or s.gets <= s.stall_times)
        pos, sent_here, writes = start, 0, 0
        chunk = s.trickle[0] if s.trickle else s.chunk
        while pos < size:
            end = min(size, pos + chunk)
            if s.pause_at is not None and pos <= s.pause_at < end:
                end = max(pos, s.pause_at)
            if stalls and pos < s.stall_after < end:  # type: ignore[operator]
                end = s.stall_after  # type: ignore[assignment]
            if end > pos:
                if s.lockstep is not None:
                    if s.wake is None:
                        s.wake = asyncio.Event()
                    while s.allowed <= writes and not s.held:
                        s.wake.clear()
                        await s.wake.wait()
                    if writes >= s.lockstep or s.held:
                        await asyncio.sleep(3600)
                await resp.write(s.data[pos:end])
                writes += 1
                s.sent += end - pos
                sent_here += end - pos
                answer.sent += end - pos
                pos = end
            if s.pause_at is not None and pos == s.pause_at:
                s.pause_at = None
                if s.on_pause:
                    # Off the loop: bytes aiohttp has accepted but the socket has not
                    # taken yet are flushed only while this loop runs, and on_pause
                    # may wait for the client to have them.
                    await _in_thread(s.on_pause)
                await _in_thread(s.release.wait)
            if stalls and pos >= s.stall_after:  # type: ignore[operator]
                await asyncio.sleep(3600)  # silent until the client gives up on us
            if s.trickle:
                await asyncio.sleep(s.trickle[1])
        await resp.write_eof()
        return resp


def tls_server_context(directory: Path) -> tuple[ssl.SSLContext, Path]:
    """(server context, CA bundle): a fresh CA and a certificate for 127.0.0.1 and localhost.

    Issued with the fleet's own PKI code (``llmgw.tls``).  The CA bundle is what a
    client must be told to trust (``SSL_CERT_FILE``); nothing else trusts it.
    """
    from llmgw.tls.ca import init_ca
    from llmgw.tls.issue import issue_server

    ca = init_ca(directory / "ca", common_name="weights test CA")
    cert, key = issue_server(ca, ["localhost"], ["127.0.0.1"])
    (directory / "server.crt").write_bytes(cert)
    (directory / "server.key").write_bytes(key)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(directory / "server.crt", directory / "server.key")
    return ctx, ca.cert_path


async def _in_thread(fn: Callable[[], object]) -> None:
    """Run a blocking ``fn`` on a thread of its own and wait for it without blocking the loop.

    Not the loop's default executor: a paused response whose client was killed
    waits on ``release`` until the server closes, and a few of those would fill
    that small pool and stop every later pause from running at all.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle(how: Callable[..., object], *args: object) -> None:
        try:
            loop.call_soon_threadsafe(how, *args)
        except RuntimeError:
            pass  # the server stopped first: nobody is waiting any more

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            settle(done.set_exception, e)
        else:
            settle(done.set_result, None)

    threading.Thread(target=run, daemon=True).start()
    await done


# ------------------------------------------------------------------ inotify

class DirWatcher:
    """Every inotify event on one directory, recorded by name (Linux; ctypes, no dependency).

    Used to show that the final name only ever *appears* by a rename
    (IN_MOVED_TO) and is never created or written under that name.
    """

    IN_MODIFY, IN_CLOSE_WRITE, IN_MOVED_TO, IN_CREATE = 0x2, 0x8, 0x80, 0x100
    NAMES = {0x2: "modify", 0x8: "close_write", 0x80: "moved_to", 0x100: "create"}

    def __init__(self, directory) -> None:
        import ctypes
        import os

        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        mask = self.IN_MODIFY | self.IN_CLOSE_WRITE | self.IN_MOVED_TO | self.IN_CREATE
        if self._libc.inotify_add_watch(self.fd, str(directory).encode(), mask) < 0:
            raise OSError(ctypes.get_errno(), "inotify_add_watch")
        self.events: list[tuple[str, str]] = []

    def drain(self) -> list[tuple[str, str]]:
        import os
        import struct

        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return self.events
            i = 0
            while i < len(data):
                _wd, mask, _cookie, length = struct.unpack_from("iIII", data, i)
                name = data[i + 16: i + 16 + length].rstrip(b"\0").decode()
                for bit, what in self.NAMES.items():
                    if mask & bit:
                        self.events.append((what, name))
                i += 16 + length

    def close(self) -> None:
        import os

        os.close(self.fd)


def mirror(srv: WeightsServer, prefix: str, files: dict[str, bytes], *, lie: set[str] = frozenset(),
           **switches) -> tuple[str, str]:
    """Serve ``files`` under ``prefix/`` with their manifest; (source URL, manifest sha256).

    A path in ``lie`` is listed with the digest of other bytes: the mirror serves a corrupted file.
    """
    listed = [{"path": p, "size": len(d),
               "sha256": hashlib.sha256(d if p not in lie else b"not " + d).hexdigest()} for p, d in files.items()]
    data = json.dumps({"format": "llmgw-repository/1", "revision": "test", "files": listed}).encode()
    for p, d in files.items():
        srv.add(f"{prefix}/{p}", d, **switches)
    srv.add(f"{prefix}/llmgw-manifest.json", data)
    return srv.url(f"{prefix}/"), hashlib.sha256(data).hexdigest()
