"""Relay a committed SSE stream from inside the upstream connection's read callback.

Why this exists: on aiohttp's ordinary path every upstream read costs a
future, a task wake-up, ``readany``'s buffer bookkeeping and the chain of
coroutines behind ``StreamResponse.write``, which together cost more CPU
than the relay's own work and made the router's CPU per chunk several
times nginx's.  Once a stream is committed, the relay's work per read is
small and synchronous (find the last event boundary, frame, write), so it
is done where the bytes arrive: the upstream transport's protocol is
wrapped for the rest of the stream, aiohttp's own protocol still parses
the response (chunked decoding, end of message, keep-alive bookkeeping)
and the decoded bytes are written to the client transport with no task in
between.  The relay task only sleeps until the stream ends, fails, or the
client's send buffer fills (then it waits for the client to drain while
upstream reading is paused: back-pressure, as before).

Only complete events are written; the bytes of an unterminated event stay
in the ``EventBuffer``, so a stream that breaks never forwards half an
event.  When aiohttp's internals are not as expected (a buffered protocol,
a compressed or non-HTTP writer, no transport) ``attach`` returns None and
the caller uses the ordinary read/write loop.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any, Callable

import aiohttp

from .sse import ERROR_MARK, EventBuffer, ends_with_done, first_error

RUNNING, PAUSED, DONE = 0, 1, 2  # Splice.state
CLIENT_GONE = "client_gone"  # Splice.run() results
EOF = "eof"
_READER_FIELDS = ("_buffer", "_buffer_offset", "_size", "_cursor", "_http_chunk_splits", "_protocol")


def can_take_all(content: aiohttp.StreamReader) -> bool:
    """Whether ``take_all`` knows this StreamReader's layout (else ``read_nowait`` is used)."""
    return (type(content) is aiohttp.StreamReader and all(hasattr(content, f) for f in _READER_FIELDS)
            and isinstance(content._buffer, collections.deque))


def take_all(content: aiohttp.StreamReader) -> bytes:
    """Everything ``content`` holds, as one bytes object; what ``read_nowait()`` returns, cheaper.

    aiohttp keeps one buffer entry per HTTP chunk, and an engine sends one
    chunk per event, so a read of 60 events is 60 entries; ``read_nowait``
    pops them one by one, each pop with its own flow-control bookkeeping
    and resume call, which cost more than everything else the relay does
    per read.  This takes them in one join.  Only for readers that
    ``can_take_all`` vouched for, with no exception set and no waiter.
    """
    buf = content._buffer
    if not buf:
        return b""
    if content._buffer_offset:
        return content.read_nowait()
    data = b"".join(buf)  # one entry: that entry itself, no copy
    buf.clear()
    n = len(data)
    content._size -= n
    content._cursor += n
    splits = content._http_chunk_splits
    if splits:
        splits.clear()  # offsets of chunk ends already read; only readchunk() uses them
    content._protocol.resume_reading()  # as read_nowait does once the buffer is low
    return data


async def read_any(content: aiohttp.StreamReader) -> bytes:
    """``content.readany()``, with everything buffered taken in one join (see ``take_all``).

    Only for readers that ``can_take_all`` vouched for; the wait is readany's own.
    """
    if content._exception is not None:
        raise content._exception
    while not content._buffer and not content._eof:
        await content._wait("readany")
    return take_all(content)


class Splice(asyncio.Protocol):
    """Stands in for the upstream connection's protocol while a committed stream is relayed."""

    __slots__ = ("_loop", "_up", "_orig", "_orig_data_received", "_content", "_down", "_chunked",
                 "_server_proto", "_writer", "_feed", "_observe", "_clock", "_waiter", "state", "result",
                 "error", "wd", "saw_error", "tail", "last_write", "_attached", "_reading_paused", "_take",
                 "final", "pauses")

    def __init__(self, loop: asyncio.AbstractEventLoop, up: Any, orig: Any,
                 content: aiohttp.StreamReader, down: asyncio.Transport, chunked: bool, server_proto: Any,
                 writer: Any, buf: EventBuffer, observe: Callable[[float, float], None], wd: Any,
                 last_write: float, tail: bytes, saw_error: bool) -> None:
        self._loop = loop
        self._up = up
        self._orig = orig
        self._orig_data_received = orig.data_received if orig is not None else None
        self._content = content
        self._down = down
        self._chunked = chunked
        self._server_proto = server_proto
        self._writer = writer
        self._feed = buf.feed
        self._observe = observe
        self._clock = time.perf_counter
        self._waiter: asyncio.Future[None] | None = None
        self.state = RUNNING
        self.result = EOF
        self.error: BaseException | None = None
        self.wd = wd  # anything with .last (the time of the last upstream chunk) and .writing
        self.saw_error = saw_error
        self.tail = tail  # the last bytes written: does the stream end with [DONE]?
        self.last_write = last_write
        self._attached = False
        self._reading_paused = False
        self._take = take_all if can_take_all(content) else aiohttp.StreamReader.read_nowait
        # the stream's last events, [DONE] included, when they arrived with the end of the body:
        # the caller sends them with the chunked terminator in one write (write_eof)
        self.final = b""
        self.pauses = 0  # times the client's full send buffer paused upstream reading

    # -- setup / teardown ----------------------------------------------------

    @classmethod
    def attach(cls, request: Any, resp: aiohttp.ClientResponse, buf: EventBuffer,
               observe: Callable[[float, float], None], wd: Any, last_write: float, tail: bytes,
               saw_error: bool) -> "Splice | None":
        """Take over relaying ``resp``'s body to ``request``'s client, or None to stay on aiohttp's path.

        Must be called with no await between the response's last read and the
        first write after it, like any other step of the relay loop.
        """
        content = resp.content
        down = request.transport
        writer = request.writer
        server_proto = request.protocol
        chunked = getattr(writer, "chunked", None)
        if (down is None or down.is_closing() or not isinstance(chunked, bool)
                or getattr(writer, "_compress", None) is not None or content.exception() is not None
                or not isinstance(getattr(server_proto, "writing_paused", None), bool)):
            return None
        up = orig = None
        if not content.is_eof():  # else the whole body is buffered and the connection already released
            conn = resp.connection
            if conn is None:
                return None
            up, orig = conn.transport, conn.protocol
            if (up is None or orig is None or up.is_closing() or isinstance(orig, asyncio.BufferedProtocol)
                    or not hasattr(up, "set_protocol") or up.get_protocol() is not orig):
                return None
        self = cls(asyncio.get_running_loop(), up, orig, content, down, chunked, server_proto, writer, buf,
                   observe, wd, last_write, tail, saw_error)
        pending = self._take(content)  # read by aiohttp since the last readany, not yet relayed
        if pending:
            self._relay(pending, content.is_eof())
        if content.is_eof():
            self._finish(EOF, None)  # all relayed; a full client buffer is drained by write_eof
        if self.state != DONE:
            up.set_protocol(self)
            self._attached = True
        return self

    def detach(self) -> None:
        """Give the connection back to aiohttp's protocol (before it is released, closed or reused)."""
        if self._attached:
            self._attached = False
            up = self._up
            if up.get_protocol() is self:
                up.set_protocol(self._orig)
            if self._reading_paused:
                self._reading_paused = False
                try:
                    up.resume_reading()
                except (RuntimeError, AttributeError):  # closed meanwhile
                    pass

    def abort(self, exc: BaseException) -> None:
        """End the relay with ``exc`` (the watchdog's way to cut a stalled stream)."""
        self._finish(EOF, exc)

    async def run(self) -> str:
        """Sleep until the stream ends: ``EOF`` or ``CLIENT_GONE``; raises what broke the stream."""
        while True:
            state = self.state
            if state == DONE:
                break
            if state == PAUSED:
                # the client's send buffer is full: upstream reading is paused until it drains;
                # this wait is the client's slowness, not the engine's silence
                self.wd.writing = True
                try:
                    await self._writer.drain()
                except (ConnectionError, aiohttp.ClientConnectionError):
                    self._finish(CLIENT_GONE, None)
                    break
                finally:
                    self.wd.writing = False
                if self.state == PAUSED:
                    self.state = RUNNING
                    if self._reading_paused:
                        self._reading_paused = False
                        self._up.resume_reading()
                continue
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self.error is not None:
            raise self.error
        return self.result

    def _finish(self, result: str, exc: BaseException | None) -> None:
        if self.state == DONE:
            return
        self.state = DONE
        self.result = result
        self.error = exc
        self.detach()
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- the per-read path ---------------------------------------------------

    def _relay(self, chunk: bytes, at_eof: bool) -> None:
        t = self._clock()
        self.wd.last = t
        complete = self._feed(chunk)
        if not complete:
            return  # the rest of an event: held until its blank line arrives
        if ERROR_MARK in complete and first_error(complete) is not None:
            self.saw_error = True
        if at_eof and not self.saw_error and ends_with_done(complete):
            self.final = complete  # the body ended with this read: goes out with the terminator
        else:
            down = self._down
            if down.is_closing():
                self._finish(CLIENT_GONE, None)
                return
            if self._chunked:
                down.write(b"%x\r\n%b\r\n" % (len(complete), complete))
            else:
                down.write(complete)
        self._observe(t - self.last_write, t)
        self.last_write = t
        self.tail = complete
        if self._server_proto.writing_paused and self.state == RUNNING and self._up is not None:
            self.state = PAUSED
            self.pauses += 1
            self._reading_paused = True
            self._up.pause_reading()
            self._wake()

    def data_received(self, data: bytes) -> None:
        self._orig_data_received(data)  # aiohttp decodes; the body lands in the response's reader
        content = self._content
        exc = content.exception()
        if exc is not None:
            self._finish(EOF, exc)
            return
        at_eof = content.is_eof()
        body = self._take(content)
        if body and self.state != DONE:
            self._relay(body, at_eof)
        if at_eof and self.state != DONE:
            self._finish(EOF, None)

    def eof_received(self) -> bool | None:
        return self._orig.eof_received()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._attached = False  # the transport is gone; nothing to hand back
        self._orig.connection_lost(exc)
        err = self._content.exception()
        if err is None and not self._content.is_eof():
            err = aiohttp.ServerDisconnectedError()
        self._finish(EOF, err)

    def pause_writing(self) -> None:
        self._orig.pause_writing()

    def resume_writing(self) -> None:
        self._orig.resume_writing()
