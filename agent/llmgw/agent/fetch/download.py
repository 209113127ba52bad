"""One download, start to promotion: the I/O half of the fetcher.

The order of events, each step for a reason:

1. Under an advisory lock (``lock``: saves bandwidth, never trusted), look
   at the final path.  Present means done: only a complete, verified file is
   ever renamed there.  With a declared sha256 an existing file is checked
   once (a stamp beside it remembers the result for that inode and mtime).
2. Claim this node's leftover partial from a dead fetcher, if any
   (``scratch``), and decide how much of it may be kept (``resume``).
3. GET with Range/If-Range; judge the answer (``resume.judge``); check the
   free space against the announced length before writing a byte.
4. Stream the body into the partial file: large reads, one ``os.write``
   each, nothing else per chunk but a clock read.  Every
   ``checkpoint_bytes`` the file is fsync'd and the sidecar records how much
   is durable, which is all a resume after a reboot trusts.
5. No byte for ``stall_timeout`` (aiohttp's per-read timeout), a dropped
   connection or a 5xx is retried from where it stopped, with jittered
   exponential backoff, and reported on the progress line meanwhile, so a
   slow download and a hung one look different; ``attempts`` failures in a
   row without a byte of progress fail the fetch with the last reason.
6. ENOSPC (or a quota) mid-download removes the partial file: it cannot be
   finished where it is, and it holds the space others need.  A fetch that
   fails (or is cancelled) with nothing in its partial file removes that file
   and its sidecar too (a refused free-space check, a 404, a stall before the
   first byte): an empty partial is not resume state.
7. fsync the file; verify the declared sha256 against what is on disk; a
   mismatch removes the file and promotes nothing.  Then rename onto the
   final name and fsync the directory (``durable.promote``).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import secrets
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Callable

import aiohttp

from llmgw.agent import procident
from llmgw.agent.backoff import Backoff
from llmgw.agent.fetch import durable, lock, naming, scratch
from llmgw.agent.fetch.progress import RateMeter, Snapshot
from llmgw.agent.fetch.resume import Action, Meta, judge, request_headers, resume_offset
from llmgw.settings import FetchPolicy

log = logging.getLogger(__name__)

READ_SIZE = 8 << 20  # upper bound per read; a read returns what has arrived, up to this
STREAM_BUFFER = 8 << 20  # aiohttp's read-ahead: keeps the socket from being paused per chunk
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class FetchError(Exception):
    """A download that failed for a reason an operator can act on (the shard's reason)."""


class _Transient(Exception):
    """Worth another try from where we are."""


class _Outcome(Enum):
    DONE = "done"
    RESTART = "restart"


def gib(n: int | None) -> str:
    return "?" if n is None else f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def _of(done: int, total: int | None) -> str:
    return f"{gib(done)} of {gib(total)}" if total is not None else f"{gib(done)} (length unknown)"


@dataclass
class Job:
    url: str
    final: Path
    node_id: str
    sha256: str | None
    policy: FetchPolicy
    publish: Callable[[Snapshot], None]


async def run(job: Job) -> str:
    """Fetch ``job.url`` to ``job.final``; return the final path or raise FetchError."""
    directory, name = job.final.parent, job.final.name
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FetchError(f"cannot create {directory}: {e}") from e
    async with lock.held(directory / naming.lock_name(name)):
        scratch.sweep_orphans(directory, name, job.node_id)  # e.g. a fetcher killed right after its rename
        if await _present(job):
            return str(job.final)
        owner = scratch.me(secrets.token_hex(3))
        part = directory / naming.partial_name(name, job.node_id, owner)
        meta_path = directory / naming.meta_name(part.name)
        scratch.ACTIVE.add(owner.nonce)
        try:
            scratch.claim(directory, name, job.node_id, part)
            t0 = time.monotonic()
            transfer = _Transfer(job, part, meta_path)
            await transfer.run()
            await _verify_and_promote(job, part, meta_path)
        finally:
            scratch.ACTIVE.discard(owner.nonce)
        took = time.monotonic() - t0
        log.info("fetched %s to %s: %s in %.1fs (%s received this time)", job.url, job.final,
                 gib(transfer.done), took, gib(transfer.received))
        return str(job.final)


async def _present(job: Job) -> bool:
    final = job.final
    if not final.exists():
        return False
    if not final.is_file():
        raise FetchError(f"{final} exists and is not a regular file")
    if job.sha256 is None:
        log.info("%s is present; not fetching %s", final, job.url)
        return True
    stamp = final.with_name(naming.verified_name(final.name))
    expected_stamp = durable.stamp_text(final, job.sha256)
    try:
        if expected_stamp is not None and stamp.read_text() == expected_stamp:
            return True
    except OSError:
        pass
    actual = await asyncio.to_thread(durable.sha256_file, final)
    if actual == job.sha256:
        _write_stamp(final, job.sha256)
        return True
    log.warning("%s is present but its sha256 is %s, not the declared %s; fetching %s again",
                final, actual, job.sha256, job.url)
    return False


def _write_stamp(final: Path, sha256: str) -> None:
    text = durable.stamp_text(final, sha256)
    if text is not None:
        try:
            durable.write_text(final.with_name(naming.verified_name(final.name)), text)
        except OSError as e:  # only an optimisation: the next start hashes again
            log.debug("cannot write verified stamp for %s: %s", final, e)


async def _verify_and_promote(job: Job, part: Path, meta_path: Path) -> None:
    if job.sha256 is not None:
        actual = await asyncio.to_thread(durable.sha256_file, part)
        if actual != job.sha256:
            durable.remove(part, meta_path)
            raise FetchError(f"sha256 mismatch: expected {job.sha256}, got {actual}; the download was "
                             f"discarded and nothing was promoted")
    durable.promote(part, job.final)
    durable.remove(meta_path)
    if job.sha256 is not None:
        _write_stamp(job.final, job.sha256)


class _Transfer:
    """Bytes from the server into ``part``, across as many connections as it takes."""

    def __init__(self, job: Job, part: Path, meta_path: Path):
        self.job, self.part, self.meta_path = job, part, meta_path
        self.policy = job.policy
        self.meta: Meta | None = durable.read_meta(meta_path) if part.exists() else None
        self.boot = procident.boot_id()
        self.done = 0  # bytes in the partial file that belong to the download
        self.total: int | None = None if self.meta is None else self.meta.total
        self.received = 0  # bytes read from the network, all attempts
        self.meter = RateMeter()

    # ------------------------------------------------------------------ driver
    async def run(self) -> None:
        fd = os.open(self.part, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                await self._loop(fd)
                await asyncio.to_thread(os.fsync, fd)
            except OSError as e:
                if e.errno not in NO_SPACE:
                    raise FetchError(f"writing {self.part}: {e}") from e
                durable.remove(self.part, self.meta_path)
                free = _free_or_unknown(self.part.parent)
                raise FetchError(f"no space left on device in {self.part.parent} after writing "
                                 f"{_of(self.done, self.total)} ({free} free); the partial file was removed") from e
            except BaseException:
                if _empty(fd):  # nothing to resume from: leave nothing behind
                    durable.remove(self.part, self.meta_path)
                raise
        finally:
            os.close(fd)

    async def _loop(self, fd: int) -> None:
        p = self.policy
        size = os.fstat(fd).st_size
        keep = resume_offset(size, self.meta, self.job.url, self.boot)
        if keep != size:
            if size:
                log.info("%s: keeping %d of %d bytes on disk", self.job.url, keep, size)
            os.ftruncate(fd, keep)
        if keep == 0:
            self.meta = None
        self.done = keep
        backoff = Backoff(p.backoff_initial, p.backoff_max)
        timeout = aiohttp.ClientTimeout(total=None, connect=p.connect_timeout, sock_read=p.stall_timeout)
        failures, restarts = 0, 0
        connector = aiohttp.TCPConnector(limit=1, force_close=True)
        async with aiohttp.ClientSession(connector=connector, auto_decompress=False, timeout=timeout,
                                         read_bufsize=STREAM_BUFFER) as session:
            while True:
                began = self.done
                try:
                    outcome = await self._attempt(session, fd)
                    if outcome is _Outcome.DONE:
                        return
                    restarts += 1
                    if restarts > 3:
                        raise FetchError("the server keeps answering in ways that cannot be resumed; giving up")
                    continue
                except _Transient as e:
                    reason = str(e)
                except aiohttp.ServerTimeoutError:
                    reason = f"stalled: no bytes for {p.stall_timeout:g}s at {_of(self.done, self.total)}"
                except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.IncompleteReadError,
                        ConnectionError, asyncio.TimeoutError) as e:
                    reason = f"connection failed at {_of(self.done, self.total)}: {type(e).__name__}: {e}".rstrip(": ")
                if self.done > began:
                    failures = 0
                    backoff.reset()
                failures += 1
                if failures >= p.attempts:
                    raise FetchError(f"{reason}; gave up after {p.attempts} attempt(s) without progress")
                delay = backoff.next_delay()
                log.warning("fetch %s: %s; retry %d of %d in %.1fs", self.job.url, reason, failures,
                            p.attempts - 1, delay)
                self.job.publish(Snapshot(self.done, self.total, None,
                                          f"{reason}; retry {failures} of {p.attempts - 1} in {delay:.0f}s"))
                await asyncio.sleep(delay)

    # ----------------------------------------------------------------- attempt
    async def _attempt(self, session: aiohttp.ClientSession, fd: int) -> _Outcome:
        headers, asked = request_headers(self.done, self.meta)
        async with session.get(self.job.url, headers=headers) as resp:
            d = judge(resp.status, resp.reason or "", resp.headers, asked, self.meta)
            if d.action is Action.FAIL:
                raise FetchError(d.reason)
            if d.action is Action.RETRY:
                raise _Transient(d.reason)
            if d.action is Action.RESTART:
                log.warning("fetch %s: %s; starting over", self.job.url, d.reason)
                self._reset(fd)
                if asked is None:
                    raise FetchError(d.reason)
                return _Outcome.RESTART
            if d.action is Action.WHOLE:
                if self.done:
                    log.warning("fetch %s: %s; starting over", self.job.url, d.reason or "whole body sent")
                self._reset(fd)
            self.total = d.total
            self._check_space()  # before the sidecar too: on a full disk nothing at all is written
            durable_now = self.meta.durable if (self.meta is not None and d.action is Action.APPEND) else 0
            self.meta = Meta(self.job.url, d.validator, d.total, self.boot, durable_now)
            durable.write_text(self.meta_path, self.meta.to_json())
            body = resp.content
            if d.action is Action.APPEND:
                first = await body.readexactly(1)
                self.received += 1
                if os.pread(fd, 1, d.start) != first:
                    log.warning("fetch %s: byte %d differs from the one on disk; starting over",
                                self.job.url, d.start)
                    self._reset(fd)
                    return _Outcome.RESTART
            os.lseek(fd, self.done, os.SEEK_SET)
            now = asyncio.get_running_loop().time()
            self.meter.restart(now, self.done)
            self.job.publish(Snapshot(self.done, self.total, self.meter.rate))
            raw = _raw_body_fd(resp)
            if raw is None:
                await self._stream(body, fd)
            else:
                await self._stream_raw(raw, fd)
        if self.total is not None and self.done < self.total:
            raise _Transient(f"connection closed at {_of(self.done, self.total)}")
        return _Outcome.DONE

    async def _stream(self, body: aiohttp.StreamReader, fd: int) -> None:
        """The hot loop: read what has arrived, write it, and only glance at the clock."""
        loop = asyncio.get_running_loop()
        interval = self.policy.progress_interval
        next_report = loop.time() + interval
        step = self.policy.checkpoint_bytes
        next_checkpoint = self.done + step
        limit = self.total
        done = first = self.done
        read, write = body.read, os.write
        try:
            while True:
                chunk = await read(READ_SIZE)
                if not chunk:
                    break
                n = len(chunk)
                if limit is not None and done + n > limit:
                    raise _Transient(f"server sent more than the {limit} bytes it announced")
                written = write(fd, chunk)
                if written != n:
                    _write_all(fd, memoryview(chunk)[written:])
                done += n
                self.done = done
                if done >= next_checkpoint:
                    await self._checkpoint(fd)
                    next_checkpoint = done + step
                now = loop.time()
                if now >= next_report:
                    self.job.publish(Snapshot(done, limit, self.meter.sample(now, done)))
                    next_report = now + interval
        finally:
            self.received += done - first
            self.done = done

    async def _stream_raw(self, raw: tuple[int, bytes], fd: int) -> None:
        """The hot loop for a plain-HTTP body of known length: socket -> one buffer -> file.

        aiohttp's body path allocates a bytes object per socket read and
        copies it again on the way to us; for multi-gigabyte bodies that
        is most of the client's CPU.  Here the body is read with
        ``os.readv`` into one preallocated buffer and written from it, which
        is what curl does.  The stall timeout is a watchdog on the time of
        the last byte, not a timer per read.
        """
        sock_fd, buffered = raw
        loop = asyncio.get_running_loop()
        assert self.total is not None
        limit = self.total
        if buffered:
            self._write_chunk(fd, buffered)
        buf = bytearray(READ_SIZE)
        view = memoryview(buf)
        rfd = os.dup(sock_fd)  # the transport's own fd may not get a second reader
        waiter: asyncio.Future[None] | None = None
        stall = self.policy.stall_timeout
        last_byte = loop.time()

        def readable() -> None:
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

        def watchdog() -> None:
            nonlocal handle
            idle = loop.time() - last_byte
            if idle >= stall:
                if waiter is not None and not waiter.done():
                    waiter.set_exception(aiohttp.ServerTimeoutError(f"no bytes for {stall:g}s"))
                handle = loop.call_later(stall, watchdog)
            else:
                handle = loop.call_later(stall - idle, watchdog)

        handle = loop.call_later(stall, watchdog)
        interval = self.policy.progress_interval
        next_report = loop.time() + interval
        step = self.policy.checkpoint_bytes
        next_checkpoint = self.done + step
        done = first = self.done
        readv, write = os.readv, os.write
        loop.add_reader(rfd, readable)
        try:
            while done < limit:
                want = limit - done
                try:
                    n = readv(rfd, [view if want >= READ_SIZE else view[:want]])
                except BlockingIOError:
                    waiter = loop.create_future()
                    await waiter
                    continue
                if n == 0:
                    break  # the server closed early: the caller retries from here
                last_byte = now = loop.time()
                written = write(fd, view[:n])
                if written != n:
                    _write_all(fd, view[written:n])
                done += n
                self.done = done
                if done >= next_checkpoint:
                    await self._checkpoint(fd)
                    next_checkpoint = done + step
                if now >= next_report:
                    self.job.publish(Snapshot(done, limit, self.meter.sample(now, done)))
                    next_report = now + interval
        finally:
            handle.cancel()
            loop.remove_reader(rfd)
            os.close(rfd)
            self.received += done - first
            self.done = done

    def _write_chunk(self, fd: int, chunk: bytes) -> None:
        written = os.write(fd, chunk)
        if written != len(chunk):
            _write_all(fd, memoryview(chunk)[written:])
        self.done += len(chunk)
        self.received += len(chunk)

    async def _checkpoint(self, fd: int) -> None:
        """fsync the prefix written so far and record it as what survives a reboot."""
        upto = self.done
        await asyncio.to_thread(os.fsync, fd)
        if self.meta is not None:
            self.meta = Meta(self.meta.url, self.meta.validator, self.meta.total, self.meta.boot_id, upto)
            durable.write_text(self.meta_path, self.meta.to_json())

    def _check_space(self) -> None:
        if self.total is None:
            return
        need = self.total - self.done
        free = durable.free_bytes(self.part.parent)
        if need > free:
            raise FetchError(f"not enough space in {self.part.parent}: {_of(self.done, self.total)} on disk, "
                             f"{gib(need)} more needed, {gib(free)} free")

    def _reset(self, fd: int) -> None:
        os.ftruncate(fd, 0)
        self.done, self.total, self.meta = 0, None, None
        durable.remove(self.meta_path)


def _raw_body_fd(resp: aiohttp.ClientResponse) -> tuple[int, bytes] | None:
    """Take the body of ``resp`` off aiohttp: (socket fd, bytes aiohttp already buffered), or None.

    Only for a plain-TCP, identity-coded body with a Content-Length (TLS and
    chunked bodies stay on aiohttp's path).  aiohttp's protocol is paused
    first, which also drops its read timer, and nothing resumes it: the
    buffered bytes are taken with no await in between, and the connection
    is closed, never reused, when the response is released (the session
    uses ``force_close``).
    """
    conn = resp.connection
    if conn is None or conn.transport is None or resp.content_length is None:
        return None
    if resp.headers.get("Transfer-Encoding") or resp.headers.get("Content-Encoding", "identity") != "identity":
        return None
    transport = conn.transport
    if transport.get_extra_info("sslcontext") is not None or transport.get_extra_info("ssl_object") is not None:
        return None
    sock = transport.get_extra_info("socket")
    if sock is None or conn.protocol is None:
        return None
    try:
        sock_fd = sock.fileno()
    except OSError:
        return None
    if sock_fd < 0:
        return None
    buffered = resp.content.read_nowait()
    conn.protocol.pause_reading()
    return sock_fd, buffered


def _empty(fd: int) -> bool:
    try:
        return os.fstat(fd).st_size == 0
    except OSError:
        return False


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _free_or_unknown(directory: Path) -> str:
    try:
        return gib(durable.free_bytes(directory))
    except OSError:
        return "unknown"
