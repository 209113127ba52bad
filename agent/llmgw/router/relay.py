"""Past the commit point: relay a committed stream to the client, event-aligned, until [DONE] or failure.

The router's hottest path: the splice (``splice.py``) relays from the
upstream's read callback where it can, else a per-chunk loop of locals with
one clock read and no parsing unless an error may be in the chunk.  A
failure here cannot be retried (the client already has tokens), so it ends
the stream with an explicit error event; the attempt's outcome is recorded
against the endpoint exactly once, however the relay ends.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
from aiohttp import web

from .context import RequestContext
from .errors import sse_error_events
from .failures import UPSTREAM_ERRORS
from .metrics import BatchedHistogram, RouterMetrics
from .runtime import EndpointRuntime, ModelGroup, Routing
from .settings import RouterSettings
from .splice import CLIENT_GONE, DONE as SPLICE_DONE, Splice
from .sse import DONE, ERROR_MARK, EventBuffer, ends_with_done, first_error
from .upstream import Connection
from .watchdog import StreamStalled, Watchdog

log = logging.getLogger("llmgw.router")

# aiohttp writes a StreamResponse's head at prepare() unless this (private) class attribute is
# False, as it is for web.Response: then the head goes out with the first write, in one send.
# There is no public switch; tests/unit/test_private_api_guards.py fails, naming it, if aiohttp
# drops or stops reading it (the stream would still work, one send slower per response).
HOLD_HEADERS_ATTR = "_send_headers_immediately"


class Relay:
    """One per router: streams hold their state in locals, never in an object of their own."""

    def __init__(self, settings: RouterSettings, routing: Routing, metrics: RouterMetrics) -> None:
        self.s = settings
        self.routing = routing
        self.metrics = metrics

    async def relay(self, request: web.Request, ctx: RequestContext, rt: EndpointRuntime, group: ModelGroup,
                    resp: Connection, buf: EventBuffer, held: list[bytes],
                    total_deadline: float) -> web.StreamResponse:
        """Past the commit point: relay raw bytes, event-aligned, until [DONE] or failure."""
        loop = asyncio.get_running_loop()
        out = web.StreamResponse(status=200, headers={
            "Content-Type": resp.head.headers.get("content-type", "text/event-stream"),
            "Cache-Control": "no-cache",
            "X-Request-Id": ctx.rid,
        })
        # a limited key's stream (limitsgate): rate-limit headers, and its events read for usage;
        # a cache-aware model's (cachehits): its usage's cached tokens (one meter when both)
        meter = None
        if ctx.limits is not None:
            out.headers.update(ctx.limits.headers)
            meter = ctx.limits.meter
        if meter is None and ctx.cache is not None:
            meter = ctx.cache.meter
        if meter is not None:
            held = [meter.see(b"".join(held))]
            buf = meter.wrap(buf)  # what the buffer releases from now on passes the meter too
        ctx.status = 200
        m = rt.m
        outcome, failure = "cancelled", False
        saw_error = False
        tail = b""
        wd: Watchdog | None = None
        gaps: BatchedHistogram | None = None
        m.active_streams.inc()
        splice: Splice | None = None
        final = b""  # held back by the splice for write_eof
        try:
            first = b"".join(held)
            ctx.out = out
            # the headers go out with the first events, in one send
            setattr(out, HOLD_HEADERS_ATTR, False)
            try:
                await out.prepare(request)
                await out.write(first)
            except (ConnectionError, aiohttp.ClientConnectionError):
                ctx.note = "client_gone"
                return out
            now = time.perf_counter()
            ctx.ttft = now - ctx.t0
            m.ttft.observe(ctx.ttft)
            # every held event was classified before the commit (the committing read's later ones by
            # first_error): none is an error, or the attempt would have failed instead of committing
            saw_error = False
            tail = first
            wd = Watchdog(loop, self.s.timeouts.inter_token, total_deadline, resp.fail)
            gaps = BatchedHistogram(m.inter_token, now)
            observe = gaps.observe
            try:
                splice = Splice.attach(request, resp, buf, observe, wd, now, tail, saw_error)
                if splice is not None:
                    # relayed from the upstream's read callback; this task only waits for the end
                    wd.poison = splice.abort
                    try:
                        if splice.state != SPLICE_DONE:
                            wd.arm()
                        result = await splice.run()
                    finally:
                        splice.detach()
                        saw_error, tail, final = splice.saw_error, splice.tail, splice.final
                    if result == CLIENT_GONE:
                        ctx.note = "client_gone"
                        return out
                # the ordinary per-chunk loop, when the splice cannot be used: locals only, one clock
                # read, no parsing unless an error may be in it
                if splice is None:
                    wd.arm()
                readany = resp.read
                write = out.write
                feed = buf.feed
                clock = time.perf_counter
                last_write = now
                while splice is None:
                    chunk = await readany()
                    if not chunk:
                        break
                    t = clock()
                    complete = feed(chunk)
                    if not complete:
                        continue
                    if b"data:" in complete:  # progress is an event with data, not a comment
                        wd.last = t
                    if ERROR_MARK in complete and first_error(complete) is not None:
                        saw_error = True
                    wd.writing = True
                    try:
                        await write(complete)
                    except (ConnectionError, aiohttp.ClientConnectionError):
                        ctx.note = "client_gone"
                        return out
                    finally:
                        wd.writing = False
                    observe(t - last_write, t)
                    last_write = t
                    tail = complete
            except StreamStalled as e:
                outcome, failure = await self.stalled(out, ctx, rt, e)
                return out
            except UPSTREAM_ERRORS as e:
                outcome, failure = "broken", True
                await self.end_with_error(
                    out, ctx, f"stream from endpoint {rt.id} broke after output started ({type(e).__name__})",
                    "upstream_stream_broken")
                return out
            saw_done = ends_with_done(tail)
            if saw_error:
                outcome, failure = "inband_error", True
                self.metrics.error(group.model, "stream_error")
                ctx.note = "inband_error"
                if not saw_done:
                    await write_quiet(out, b"data: " + DONE + b"\n\n")
            elif not saw_done:
                outcome, failure = "broken", True
                await self.end_with_error(out, ctx, f"stream from endpoint {rt.id} ended before [DONE]",
                                          "upstream_stream_broken")
                return out
            else:
                outcome = "ok"
            try:
                await out.write_eof(final)  # the last events and the chunked terminator, one send
            except (ConnectionError, aiohttp.ClientConnectionError):
                pass
            return out
        except Exception:
            outcome, failure = "error", True  # a bug in the relay: the attempt did not end well
            raise
        finally:
            if splice is not None:
                splice.detach()  # before the connection is closed or goes back to the pool
            if wd is not None:
                wd.cancel()
            if gaps is not None:
                gaps.flush(time.perf_counter())
            if outcome == "cancelled":
                if saw_error:
                    # the client hung up on the engine's error event: still the engine's failure
                    outcome, failure = "inband_error", True
                elif ends_with_done(tail):
                    # the client hung up after [DONE] reached it, before the engine closed its end:
                    # the stream was delivered whole
                    outcome = "ok"
            ctx.delivered = outcome == "ok"
            m.active_streams.dec()
            if outcome == "ok":
                resp.release()
            else:
                resp.close()
            self.routing.record(rt, group, outcome, failure=failure)

    async def stalled(self, out: web.StreamResponse, ctx: RequestContext, rt: EndpointRuntime,
                      e: StreamStalled) -> tuple[str, bool]:
        """End a stream the watchdog cut; (outcome, counts against the endpoint)."""
        if e.reason == "total_timeout":
            # the request's own deadline: not the engine's fault
            await self.end_with_error(out, ctx, "total request timeout reached while streaming", "timeout")
            return "timeout", False
        await self.end_with_error(
            out, ctx, f"stream from endpoint {rt.id} stalled: no output for {self.s.timeouts.inter_token:g}s",
            "upstream_stream_stalled")
        return e.reason, True

    async def end_with_error(self, out: web.StreamResponse, ctx: RequestContext, message: str, code: str) -> None:
        self.metrics.error(ctx.model_label, "stream_broken")
        ctx.note = code
        log.warning("rid=%s %s", ctx.rid, message)
        await end_stream(out, message, code)


async def end_stream(out: web.StreamResponse, message: str, code: str) -> None:
    """End a started stream with an error event and [DONE]; a client already gone is no error."""
    await write_quiet(out, sse_error_events(message, code))
    try:
        await out.write_eof()
    except (ConnectionError, aiohttp.ClientConnectionError):
        pass


async def write_quiet(out: web.StreamResponse, data: bytes) -> None:
    try:
        await out.write(data)
    except (ConnectionError, aiohttp.ClientConnectionError):
        pass
