"""Relay a committed SSE stream from inside the upstream connection's read callback.

Why this exists: relaying with a task (await a read, await a write) costs
a future, a task wake-up and a chain of coroutines per upstream read, more
CPU than the relay's own work.  Once a stream is committed, the work per
read is small and synchronous (find the last event boundary, frame,
write), so it is done where the bytes arrive: the upstream ``Connection``
hands each read's decoded body to the splice (its sink), and complete
events are written to the client's transport with no task in between.
The relay task only sleeps until the stream ends, fails, or the client's
send buffer fills (then it waits for the client to drain while upstream
reading is paused: back-pressure).

Only complete events are written; the bytes of an unterminated event stay
in the ``EventBuffer``, so a stream that breaks never forwards half an
event.  When aiohttp's server internals are not as expected (a compressed
or non-HTTP writer, no transport) ``attach`` returns None and the caller
relays with an ordinary read/write loop.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import aiohttp

from .sse import ERROR_MARK, EventBuffer, ends_with_done, first_error
from .upstream import Connection

RUNNING, PAUSED, DONE = 0, 1, 2  # Splice.state
CLIENT_GONE = "client_gone"  # Splice.run() results
EOF = "eof"


class Splice:
    """The upstream connection's body sink while a committed stream is relayed."""

    __slots__ = ("_loop", "_conn", "_down", "_chunked", "_server_proto", "_writer", "_feed", "_observe",
                 "_clock", "_waiter", "state", "result", "error", "wd", "saw_error", "tail", "last_write",
                 "_attached", "_reading_paused", "final", "pauses")

    def __init__(self, loop: asyncio.AbstractEventLoop, conn: Connection, down: asyncio.Transport,
                 chunked: bool, server_proto: Any, writer: Any, buf: EventBuffer,
                 observe: Callable[[float, float], None], wd: Any, last_write: float, tail: bytes,
                 saw_error: bool) -> None:
        self._loop = loop
        self._conn = conn
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
        self.wd = wd  # anything with .last (the time of the last data event) and .writing
        self.saw_error = saw_error
        self.tail = tail  # the last bytes written: does the stream end with [DONE]?
        self.last_write = last_write
        self._attached = False
        self._reading_paused = False
        # the stream's last events, [DONE] included, when they arrived with the end of the body:
        # the caller sends them with the chunked terminator in one write (write_eof)
        self.final = b""
        self.pauses = 0  # times the client's full send buffer paused upstream reading

    # -- setup / teardown ----------------------------------------------------

    @classmethod
    def attach(cls, request: Any, conn: Connection, buf: EventBuffer, observe: Callable[[float, float], None],
               wd: Any, last_write: float, tail: bytes, saw_error: bool) -> "Splice | None":
        """Take over relaying ``conn``'s body to ``request``'s client, or None to stay on the task loop.

        Must be called with no await between the connection's last read and the
        first write after it, like any other step of the relay loop.
        """
        down = request.transport
        writer = request.writer
        server_proto = request.protocol
        chunked = getattr(writer, "chunked", None)
        if (down is None or down.is_closing() or not isinstance(chunked, bool)
                or getattr(writer, "_compress", None) is not None
                or not isinstance(getattr(server_proto, "writing_paused", None), bool)):
            return None
        self = cls(asyncio.get_running_loop(), conn, down, chunked, server_proto, writer, buf, observe, wd,
                   last_write, tail, saw_error)
        self._attached = True
        conn.set_sink(self)  # delivers what arrived since the last read at once
        return self

    def detach(self) -> None:
        """Stop receiving the body (before the connection is released or closed)."""
        if self._attached:
            self._attached = False
            conn = self._conn
            conn.set_sink(None)
            if self._reading_paused:
                self._reading_paused = False
                conn.resume_reading()

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
                        self._conn.resume_reading()
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

    # -- Sink: called from the connection's data_received ------------------------

    def body(self, data: bytes, ended: bool) -> None:
        if self.state == DONE:
            return
        if data:
            self._relay(data, ended)
        if ended:
            self._finish(EOF, None)

    def failed(self, exc: BaseException) -> None:
        self._finish(EOF, exc)

    def _relay(self, chunk: bytes, at_eof: bool) -> None:
        t = self._clock()
        complete = self._feed(chunk)
        if not complete:
            return  # the rest of an event: held until its blank line arrives
        if b"data:" in complete:  # progress is an event with data; comments (": keepalive") are not
            self.wd.last = t
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
        if self._server_proto.writing_paused and self.state == RUNNING and not at_eof:
            self.state = PAUSED
            self.pauses += 1
            self._reading_paused = True
            self._conn.pause_reading()
            self._wake()
