"""The OpenAI data path: authenticate, pick, forward, retry, relay.

Commit point.  Nothing reaches the client before the engine produced its
first token (for streams) or its whole answer (otherwise).  Until then a
failure is invisible and may be retried on another endpoint; after it, a
failure ends the stream with an explicit error event, because resending the
request elsewhere would duplicate tokens the client already has.  vLLM's
first chat chunk carries only the assistant role, so such chunks are held
back with the rest until real output arrives.

Failures that count against an endpoint (outlier ejection): connect
errors, 5xx, timeouts (per try, first token, inter token), streams that
break or end without ``[DONE]``, and in-band error events on a 200 stream.
A 4xx is the client's problem and counts as the engine being alive.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from typing import Callable

import aiohttp
from aiohttp import web

from llmgw import compat

from .auth import AuthFailure, KeyRing
from .budget import RetryBudget
from .errors import (AUTHENTICATION, INVALID_REQUEST, RATE_LIMIT, SERVER, RouterError, sse_error_events)
from .metrics import BatchedHistogram, RouterMetrics
from .request import parse_body
from .runtime import EndpointRuntime, ModelGroup, Routing
from .settings import RouterSettings
from .http1 import ProtocolError
from .splice import CLIENT_GONE, DONE as SPLICE_DONE, Splice
from .sse import (DONE, ERROR_MARK, EventBuffer, Kind, ends_with_done, error_message, event_data, first_error,
                  first_output)
from .upstream import ConnectError, Connection, UpstreamError

log = logging.getLogger("llmgw.router")
OPENAI_POST_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
access_log = logging.getLogger("llmgw.router.access")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")
_HEADER_VALUE = re.compile(r"^[\t\x20-\x7e]{1,1024}$")  # what may be copied into an engine request line
_UPSTREAM_ERRORS = (UpstreamError, ProtocolError, OSError)  # the engine connection failed
_ERROR_BODY_LIMIT = 64 * 1024
# aiohttp writes a StreamResponse's head at prepare() unless this (private) class attribute is
# False, as it is for web.Response: then the head goes out with the first write, in one send.
# There is no public switch; tests/unit/test_private_api_guards.py fails, naming it, if aiohttp
# drops or stops reading it (the stream would still work, one send slower per response).
HOLD_HEADERS_ATTR = "_send_headers_immediately"


class StreamStalled(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class Failed:
    """An attempt that failed before the commit point."""

    outcome: str  # attempts metric label
    error: RouterError  # what the client gets if no retry happens
    counts: bool = True  # against the endpoint's health
    retryable: bool = True
    upstream: web.Response | None = None  # pass-through answer (upstream 429)


def _no_poison(exc: BaseException) -> None:
    """A cancelled watchdog's poison: nothing is left to interrupt."""


class _Watchdog:
    """Inter-token and total deadlines of a committed stream without a timer per chunk.

    The relay only stores the time of the last chunk; one timer re-arms itself
    lazily and, when a deadline truly passed, poisons the upstream reader so
    the pending read raises.  Time spent writing to a slow client is not the
    engine's silence and is not counted against it.
    """

    __slots__ = ("loop", "idle", "deadline", "poison", "last", "writing", "handle", "fired")

    def __init__(self, loop: asyncio.AbstractEventLoop, idle: float, loop_deadline: float,
                 poison: Callable[[BaseException], None]) -> None:
        self.loop = loop
        self.idle = idle
        self.last = time.perf_counter()  # the relay's clock; set on every chunk
        self.deadline = self.last + (loop_deadline - loop.time())
        self.poison = poison  # makes the relay's pending wait raise
        self.writing = False
        self.fired: str | None = None
        self.handle: asyncio.TimerHandle | None = None

    def arm(self) -> None:
        """Start watching (not needed for a stream that ended before its relay had to wait)."""
        if self.handle is None:
            self.handle = self.loop.call_later(max(0.0, min(self.idle, self.deadline - self.last)), self._check)

    def _check(self) -> None:
        now = time.perf_counter()
        if now >= self.deadline:
            self._fire("total_timeout")
            return
        if self.writing:
            self.last = now
        due = self.last + self.idle
        if now >= due:
            self._fire("inter_token_timeout")
            return
        self.handle = self.loop.call_later(min(due, self.deadline) - now, self._check)

    def _fire(self, reason: str) -> None:
        self.fired = reason
        self.poison(StreamStalled(reason))

    def cancel(self) -> None:
        """Stop watching for good; also drops the references that tie the relay's objects in a cycle.

        ``poison`` is often the splice's bound ``abort`` and the splice holds this watchdog: left
        in place, every stream's splice, watchdog, timer handle, writer and histogram batch
        outlive it as cyclic garbage, and the collector's pauses (milliseconds each, every few
        seconds at a few hundred streams a second) land in the latency of whatever is in flight.
        """
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None
        self.poison = _no_poison


class Proxy:
    def __init__(self, settings: RouterSettings, routing: Routing, metrics: RouterMetrics,
                 pending: Callable[[str], float] | None = None) -> None:
        self.s = settings
        self.routing = routing
        self.metrics = metrics
        # seconds until the table can be trusted to list ``model`` (0: it can now); see build_app
        self.pending = pending
        self.keys = KeyRing(settings.api_keys, settings.allow_unauthenticated)
        r = settings.retries
        self.budget = RetryBudget(r.budget_ratio, r.budget_min, r.budget_window)
        self.started = int(time.time())
        # attempts whose client left before the first token, still watched for the engine's verdict
        self._verdicts: set[asyncio.Task] = set()
        self._closing = False

    async def close(self) -> None:
        """Shutdown: stop watching abandoned attempts (their connections are closed)."""
        self._closing = True
        tasks = list(self._verdicts)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- entry points -------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        rid = _request_id(request)
        ctx = _Ctx(rid, loop.time())
        try:
            resp = await self._handle(request, ctx)
        except RouterError as e:
            ctx.status = e.status
            self.metrics.error(ctx.model_label, e.klass)
            resp = e.response(rid)
        except asyncio.CancelledError:
            # the client went away (handler cancelled); one that left after the whole stream
            # reached it, [DONE] included, was served
            ctx.status = 200 if ctx.delivered else 499
            self._account(ctx, request, loop)
            raise
        except Exception:  # noqa: BLE001 - a bug: still an OpenAI-shaped answer, never aiohttp's text 500
            resp = await self._internal_error(ctx)
        self._account(ctx, request, loop)
        return resp

    async def _internal_error(self, ctx: "_Ctx") -> web.StreamResponse:
        log.exception("rid=%s unexpected error while handling the request", ctx.rid)
        self.metrics.error(ctx.model_label, "internal")
        ctx.note = "internal_error"
        message = f"internal router error (request id {ctx.rid})"
        out = ctx.out
        if out is not None and out.prepared:  # a stream already started: end it with an error event
            await _write_quiet(out, sse_error_events(message, "internal_error"))
            try:
                await out.write_eof()
            except (ConnectionError, aiohttp.ClientConnectionError):
                pass
            return out
        ctx.status = 500
        return RouterError(500, message, SERVER, "internal_error", klass="internal").response(ctx.rid)

    async def _simple(self, request: web.Request, fn) -> web.StreamResponse:
        """GETs and fallback answers: request id, errors as for POSTs, access log and metrics."""
        loop = asyncio.get_running_loop()
        ctx = _Ctx(_request_id(request), loop.time())
        try:
            resp = await fn(request, ctx)
        except RouterError as e:
            self.metrics.error(ctx.model_label, e.klass)
            resp = e.response(ctx.rid)
        except Exception:  # noqa: BLE001
            resp = await self._internal_error(ctx)
        ctx.status = resp.status
        resp.headers["X-Request-Id"] = ctx.rid
        self._account(ctx, request, loop)
        return resp

    def _account(self, ctx: "_Ctx", request: web.Request, loop: asyncio.AbstractEventLoop) -> None:
        dur = time.perf_counter() - ctx.t0
        self.metrics.request_done(ctx.model_label, ctx.status, dur)
        if self.s.access_log:
            access_log.info(
                'rid=%s key=%s "%s %s" model=%s status=%d endpoint=%s attempts=%d ttft_ms=%s dur_ms=%.1f%s',
                ctx.rid, ctx.key, request.method, request.path, ctx.model or "-", ctx.status,
                ctx.endpoint or "-", ctx.attempts,
                f"{(ctx.ttft * 1000):.1f}" if ctx.ttft is not None else "-", dur * 1000,
                f" note={ctx.note}" if ctx.note else "")

    def authenticate(self, request: web.Request):
        try:
            return self.keys.authenticate(request.headers.get("Authorization"))
        except AuthFailure as e:
            raise RouterError(401, str(e), AUTHENTICATION, "invalid_api_key", klass="unauthorized") from None

    async def _handle(self, request: web.Request, ctx: "_Ctx") -> web.StreamResponse:
        principal = self.authenticate(request)
        ctx.key = principal.name
        limit = self.s.limits.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise _too_large(limit)
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise _too_large(limit) from None
        parsed = parse_body(body)
        ctx.model = parsed.model
        self.routing.sync()
        group = self.routing.group(parsed.model)
        # an unknown model and one the key may not use get the same answer: a restricted key
        # must not learn which models exist
        if group is None or not principal.allows(parsed.model):
            raise self._unknown_model(parsed.model, principal.allows(parsed.model))
        ctx.model_label = parsed.model
        return await self._forward(request, ctx, group, body, parsed.stream, parsed.payload)

    # -- attempts -----------------------------------------------------------

    async def _forward(self, request: web.Request, ctx: "_Ctx", group: ModelGroup, body: bytes, stream: bool,
                       payload: dict) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        total_deadline = ctx.t0_loop + self.s.timeouts.total
        accept = request.headers.get("Accept")
        if accept is None or not _HEADER_VALUE.match(accept):
            accept = "text/event-stream" if stream else "application/json"
        # parse_body proved the body is JSON, whatever the client's Content-Type said
        headers = (b"Content-Type: application/json\r\nAccept: %s\r\nAccept-Encoding: identity\r\n"
                   b"X-Request-Id: %s\r\n" % (accept.encode("ascii"), ctx.rid.encode("ascii")))
        target = request.raw_path.encode("utf-8", "surrogateescape")  # path and query as the client sent them
        self.budget.note_request()
        tried: set[str] = set()
        last: Failed | None = None
        max_attempts = self.s.retries.max_attempts
        while True:
            # the deadline first: a retry that cannot happen spends no retry token
            now = loop.time()
            if now >= total_deadline:
                break
            pick = self.routing.pick(group, tried, payload)
            if isinstance(pick, RouterError):
                raise pick
            if pick is None:  # a retry with nothing left to try
                break
            if last is not None:
                if not self.budget.try_acquire():
                    self.metrics.retries_denied.labels(group.model).inc()
                    ctx.note = "retry_budget_exhausted"
                    break
                self.metrics.retries.labels(group.model, last.outcome).inc()
            rt = pick
            tried.add(rt.id)
            ctx.attempts += 1
            ctx.endpoint = rt.id
            rt.outstanding += 1
            try:
                if stream:
                    try_deadline = now + min(self.s.timeouts.per_try, self.s.timeouts.first_token)
                    result = await self._stream_attempt(request, ctx, rt, group, target, body, headers,
                                                        try_deadline, total_deadline)
                else:
                    result = await self._plain_attempt(ctx, rt, group, target, body, headers,
                                                       now + self.s.timeouts.per_try, total_deadline)
            finally:
                rt.outstanding -= 1
            if not isinstance(result, Failed):
                return result
            last = result
            if not result.retryable or ctx.attempts >= max_attempts:
                break
        if last is None:  # total deadline passed before any attempt
            raise RouterError(504, "request timed out before it could be sent", SERVER, "timeout",
                              klass="upstream_timeout")
        if last.upstream is not None:
            ctx.status = last.upstream.status
            self.metrics.error(ctx.model_label, last.error.klass)
            return last.upstream
        raise last.error

    async def _plain_attempt(self, ctx: "_Ctx", rt: EndpointRuntime, group: ModelGroup, target: bytes,
                             body: bytes, headers: bytes, try_deadline: float,
                             total_deadline: float) -> web.Response | Failed:
        conn: Connection | None = None
        deadline = min(try_deadline, total_deadline)
        try:
            async with compat.timeout_at(deadline):
                conn = await rt.get_pool().request(target, headers, body)
                data = await conn.read_all()
        except asyncio.CancelledError:
            if conn is not None:
                conn.close()
            self.routing.record(rt, group, "cancelled", failure=False)
            raise
        except BaseException as e:  # noqa: BLE001 - classified below, re-raised if unknown
            if conn is not None:
                conn.close()
            return self._attempt_failed(e, rt, group, ctx, "per-try timeout", deadline >= total_deadline)
        head = conn.head
        conn.release()
        status = head.status
        ctype = head.headers.get("content-type", "application/json")
        if _endpoint_fault(status):
            failed = _status_failure(status, data, ctype, rt, ctx, head.headers.get("retry-after"))
            self.routing.record(rt, group, failed.outcome, failure=failed.counts)
            return failed
        self.routing.record(rt, group, "ok" if status < 400 else "client_error", failure=False)
        ctx.status = status
        return web.Response(status=status, body=data, headers={"Content-Type": ctype, "X-Request-Id": ctx.rid})

    async def _stream_attempt(self, request: web.Request, ctx: "_Ctx", rt: EndpointRuntime, group: ModelGroup,
                              target: bytes, body: bytes, headers: bytes, try_deadline: float,
                              total_deadline: float) -> web.StreamResponse | Failed:
        conn: Connection | None = None  # once the request was sent
        resp: Connection | None = None  # once its response head arrived
        buf = EventBuffer()
        held: list[bytes] = []
        pre_deadline = min(try_deadline, total_deadline)
        try:
            async with compat.timeout_at(pre_deadline):
                conn = await rt.get_pool().send(target, headers, body)
                await conn.response()
                resp = conn
                head = resp.head
                status = head.status
                ctype = head.headers.get("content-type", "")
                if status != 200 or not ctype.startswith("text/event-stream"):
                    data = await resp.read_all(_ERROR_BODY_LIMIT if status >= 400 else None)
                    resp.release()
                    if _endpoint_fault(status):
                        failed = _status_failure(status, data, ctype, rt, ctx, head.headers.get("retry-after"))
                        self.routing.record(rt, group, failed.outcome, failure=failed.counts)
                        return failed
                    self.routing.record(rt, group, "ok" if status < 400 else "client_error", failure=False)
                    ctx.status = status
                    return web.Response(status=status, body=data,
                                        headers={"Content-Type": ctype or "application/json",
                                                 "X-Request-Id": ctx.rid})
                committed = False
                read = resp.read
                while not committed:
                    chunk = await read()
                    if not chunk:
                        resp.close()
                        self.routing.record(rt, group, "broken", failure=True)
                        return Failed("broken", RouterError(
                            502, f"endpoint {rt.id} closed the stream before the first token", SERVER,
                            "upstream_stream_broken", klass="upstream_error"))
                    complete = buf.feed(chunk)
                    if not complete:
                        continue
                    found = first_output(complete)
                    kind = found[0] if found is not None else Kind.HOLD
                    if kind is Kind.DONE:  # [DONE] before any output or finish_reason
                        resp.close()
                        self.routing.record(rt, group, "broken", failure=True)
                        return Failed("broken", RouterError(
                            502, f"endpoint {rt.id} ended the stream without any output", SERVER,
                            "upstream_stream_broken", klass="upstream_error"))
                    err = (event_data(found[1]) or b"") if kind is Kind.ERROR else None
                    committed = kind is Kind.TOKEN
                    if committed and ERROR_MARK in complete:
                        # an error later in the same read is still before anything was sent
                        err = first_error(complete)
                    if err is not None:
                        resp.close()
                        self.routing.record(rt, group, "inband_error", failure=True)
                        return Failed("inband_error", RouterError(
                            502, f"endpoint {rt.id} failed before the first token: {error_message(err)}",
                            SERVER, "upstream_error", klass="upstream_error"))
                    held.append(complete)
        except asyncio.CancelledError:
            if conn is not None and not conn.closed:
                # the client left before the first token; the engine may still be hung: let a
                # verdict task watch the attempt to its first-token deadline (it closes and records)
                self._start_verdict(conn, buf, rt, group, try_deadline)
            else:
                if conn is not None:
                    conn.close()
                self.routing.record(rt, group, "cancelled", failure=False)
            raise
        except BaseException as e:  # noqa: BLE001
            if conn is not None:
                conn.close()
            return self._attempt_failed(e, rt, group, ctx, "no first token within the first-token timeout"
                                        if resp is not None else "per-try timeout", pre_deadline >= total_deadline,
                                        "first_token_timeout" if resp is not None else "timeout")
        return await self._relay(request, ctx, rt, group, resp, buf, held, total_deadline)

    def _attempt_failed(self, e: BaseException, rt: EndpointRuntime, group: ModelGroup, ctx: "_Ctx",
                        timeout_what: str, by_total: bool, timeout_outcome: str = "timeout") -> Failed:
        """Classify and record an attempt that raised; unknown exceptions are recorded and re-raised."""
        if by_total and isinstance(e, TimeoutError):
            # the request's own deadline fired, not the engine's per-try/first-token one: not its fault
            failed = Failed("timeout", RouterError(
                504, f"total request timeout reached while waiting for endpoint {rt.id}", SERVER,
                "upstream_timeout", klass="upstream_timeout"), counts=False, retryable=False)
        else:
            try:
                failed = _classify_exception(e, rt, ctx, timeout_what)
            except BaseException:
                self.routing.record(rt, group, "error", failure=True)
                raise
            if failed.outcome == "timeout":
                failed.outcome = timeout_outcome
        self.routing.record(rt, group, failed.outcome, failure=failed.counts)
        return failed

    def _start_verdict(self, conn: Connection, buf: EventBuffer, rt: EndpointRuntime, group: ModelGroup,
                       deadline: float) -> None:
        if self._closing:
            conn.close()
            self.routing.record(rt, group, "cancelled", failure=False)
            return
        rt.outstanding += 1  # the engine still works on it: it keeps its slot until the verdict
        task = asyncio.get_running_loop().create_task(self._verdict(conn, buf, rt, group, deadline))
        self._verdicts.add(task)
        task.add_done_callback(self._verdicts.discard)

    async def _verdict(self, conn: Connection, buf: EventBuffer, rt: EndpointRuntime, group: ModelGroup,
                       deadline: float) -> None:
        """An attempt whose client left before its first token: wait (until the attempt's own
        first-token deadline) for what the engine does, so that a hung engine is still found out.
        A token: "cancelled", not a failure; silence, a broken stream, a 5xx or an in-band error:
        the failure it is."""
        outcome, failure = "cancelled", False
        head_seen = conn.head is not None
        try:
            async with compat.timeout_at(deadline):
                head = await conn.response()
                head_seen = True
                if head.status != 200 or not head.headers.get("content-type", "").startswith("text/event-stream"):
                    if head.status >= 500:
                        outcome, failure = "status_5xx", True
                    return
                while True:
                    chunk = await conn.read()
                    if not chunk:
                        outcome, failure = "broken", True
                        return
                    complete = buf.feed(chunk)
                    if not complete:
                        continue
                    found = first_output(complete)
                    if found is None:
                        continue
                    if found[0] is Kind.ERROR:
                        outcome, failure = "inband_error", True
                    elif found[0] is Kind.DONE:
                        outcome, failure = "broken", True
                    return  # else output: the engine works
        except TimeoutError:
            outcome, failure = ("first_token_timeout" if head_seen else "timeout"), True
        except _UPSTREAM_ERRORS:
            outcome, failure = "broken", True
        finally:
            conn.close()
            rt.outstanding -= 1
            self.routing.record(rt, group, outcome, failure=failure)

    async def _relay(self, request: web.Request, ctx: "_Ctx", rt: EndpointRuntime, group: ModelGroup,
                     resp: Connection, buf: EventBuffer, held: list[bytes],
                     total_deadline: float) -> web.StreamResponse:
        """Past the commit point: relay raw bytes, event-aligned, until [DONE] or failure."""
        loop = asyncio.get_running_loop()
        out = web.StreamResponse(status=200, headers={
            "Content-Type": resp.head.headers.get("content-type", "text/event-stream"),
            "Cache-Control": "no-cache",
            "X-Request-Id": ctx.rid,
        })
        ctx.status = 200
        m = rt.m
        outcome, failure = "cancelled", False
        saw_error = False
        tail = b""
        wd: _Watchdog | None = None
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
            wd = _Watchdog(loop, self.s.timeouts.inter_token, total_deadline, resp.fail)
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
                outcome, failure = await self._stalled(out, ctx, rt, e)
                return out
            except _UPSTREAM_ERRORS as e:
                outcome, failure = "broken", True
                await self._end_with_error(
                    out, ctx, f"stream from endpoint {rt.id} broke after output started ({type(e).__name__})",
                    "upstream_stream_broken")
                return out
            saw_done = ends_with_done(tail)
            if saw_error:
                outcome, failure = "inband_error", True
                self.metrics.error(group.model, "stream_error")
                ctx.note = "inband_error"
                if not saw_done:
                    await _write_quiet(out, b"data: " + DONE + b"\n\n")
            elif not saw_done:
                outcome, failure = "broken", True
                await self._end_with_error(out, ctx, f"stream from endpoint {rt.id} ended before [DONE]",
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

    async def _stalled(self, out: web.StreamResponse, ctx: "_Ctx", rt: EndpointRuntime,
                       e: StreamStalled) -> tuple[str, bool]:
        """End a stream the watchdog cut; (outcome, counts against the endpoint)."""
        if e.reason == "total_timeout":
            # the request's own deadline: not the engine's fault
            await self._end_with_error(out, ctx, "total request timeout reached while streaming", "timeout")
            return "timeout", False
        await self._end_with_error(
            out, ctx, f"stream from endpoint {rt.id} stalled: no output for {self.s.timeouts.inter_token:g}s",
            "upstream_stream_stalled")
        return e.reason, True

    async def _end_with_error(self, out: web.StreamResponse, ctx: "_Ctx", message: str, code: str) -> None:
        self.metrics.error(ctx.model_label, "stream_broken")
        ctx.note = code
        log.warning("rid=%s %s", ctx.rid, message)
        await _write_quiet(out, sse_error_events(message, code))
        try:
            await out.write_eof()
        except (ConnectionError, aiohttp.ClientConnectionError):
            pass

    # -- catalogue ------------------------------------------------------------

    def _model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.started, "owned_by": "llmgw"}

    async def list_models(self, request: web.Request) -> web.StreamResponse:
        return await self._simple(request, self._list_models)

    async def get_model(self, request: web.Request) -> web.StreamResponse:
        return await self._simple(request, self._get_model)

    async def fallback(self, request: web.Request) -> web.StreamResponse:
        """Every path and method the app has no route for: 405 on known paths, else 404."""
        return await self._simple(request, self._fallback)

    async def _list_models(self, request: web.Request, ctx: "_Ctx") -> web.Response:
        principal = self.authenticate(request)
        ctx.key = principal.name
        self.routing.sync()
        data = [self._model_card(m) for m in self.routing.models() if principal.allows(m)]
        return web.json_response({"object": "list", "data": data})

    async def _get_model(self, request: web.Request, ctx: "_Ctx") -> web.Response:
        principal = self.authenticate(request)
        ctx.key = principal.name
        self.routing.sync()
        name = request.match_info["model"]
        ctx.model = name
        if name in self.routing.models() and principal.allows(name):
            return web.json_response(self._model_card(name))
        raise self._unknown_model(name, principal.allows(name))

    def _unknown_model(self, model: str, allowed: bool) -> RouterError:
        """404 for a model the table lacks, unless the table is still filling up.

        A control plane that has just started learns its replicas from agents
        re-registering; until then "this model does not exist" would be a lie
        that OpenAI clients do not retry, so such a model is "not available
        yet": 503 with Retry-After.  A key that may not use the model always
        gets the 404, so the answer never depends on what exists.
        """
        left = self.pending(model) if allowed and self.pending is not None else 0.0
        if left > 0:
            return RouterError(503, f"model `{model}` is not available yet: the control plane has just started and "
                                    f"its engines are still reporting; retry in a few seconds",
                               SERVER, "model_not_ready", klass="unavailable",
                               retry_after=min(int(left) + 1, PENDING_RETRY_AFTER))
        return _model_not_found(model)

    async def _fallback(self, request: web.Request, ctx: "_Ctx") -> web.Response:
        if request.path in OPENAI_POST_PATHS or request.path.startswith("/v1/models"):
            allow = "POST" if request.path in OPENAI_POST_PATHS else "GET"
            err = RouterError(405, f"method {request.method} not allowed on {request.path}; use {allow}",
                              INVALID_REQUEST, "method_not_allowed", klass="method_not_allowed")
            self.metrics.error("-", err.klass)
            resp = err.response()
            resp.headers["Allow"] = allow
            return resp
        raise RouterError(404, f"unknown path {request.path}", INVALID_REQUEST, "unknown_url", klass="unknown_url")


class _Ctx:
    __slots__ = ("rid", "t0", "t0_loop", "model", "model_label", "key", "status", "endpoint", "attempts", "ttft",
                 "note", "delivered", "out")

    def __init__(self, rid: str, t0_loop: float) -> None:
        self.rid = rid
        self.t0 = time.perf_counter()  # for measurements (uvloop's loop.time() has 1 ms resolution)
        self.t0_loop = t0_loop  # for deadlines, which the loop's timers enforce
        self.model: str | None = None
        self.model_label = "-"  # only models in the table become label values
        self.key = "-"
        self.status = 0
        self.endpoint: str | None = None
        self.attempts = 0
        self.ttft: float | None = None
        self.note = ""
        self.delivered = False  # a stream relayed whole, [DONE] included
        self.out: web.StreamResponse | None = None  # the client's stream, once the relay started


def _request_id(request: web.Request) -> str:
    """The client's X-Request-Id when it is acceptable, else a generated one."""
    rid = request.headers.get("X-Request-Id")
    if rid is None or not _REQUEST_ID.match(rid):
        rid = os.urandom(12).hex()
    return rid


# Agents re-register within seconds of a control-plane restart; the grace is only the bound on
# how long that may take, so clients are told to come back soon rather than when it ends.
PENDING_RETRY_AFTER = 2


def _model_not_found(model: str) -> RouterError:
    # OpenAI's wording and shape, for unknown models and models the key may not use alike
    return RouterError(404, f"The model `{model}` does not exist or you do not have access to it.",
                       INVALID_REQUEST, "model_not_found", klass="model_not_found")


def _too_large(limit: int) -> RouterError:
    return RouterError(413, f"request body exceeds the limit of {limit} bytes", INVALID_REQUEST,
                       "request_too_large", klass="too_large")


def _classify_exception(e: BaseException, rt: EndpointRuntime, ctx: _Ctx, timeout_what: str) -> Failed:
    if isinstance(e, ConnectError):
        return Failed("connect", RouterError(
            502, f"cannot connect to endpoint {rt.id}: {e.reason}", SERVER, "upstream_connect_error",
            klass="upstream_error"))
    if isinstance(e, TimeoutError):
        return Failed("timeout", RouterError(
            504, f"endpoint {rt.id}: {timeout_what}", SERVER, "upstream_timeout", klass="upstream_timeout"))
    if isinstance(e, _UPSTREAM_ERRORS):
        return Failed("broken", RouterError(
            502, f"endpoint {rt.id} dropped the connection: {type(e).__name__}", SERVER,
            "upstream_disconnected", klass="upstream_error"))
    raise e


def _endpoint_fault(status: int) -> bool:
    """An answer that says something about the endpoint, not the client's request.

    401/403 from an engine means it refused the router's engine key (a key
    rotated by a replacement the router has not heard of yet): the client did
    nothing wrong, another replica can serve it, and passing "Unauthorized"
    through would make the client doubt its own router key.
    """
    return status >= 500 or status in (401, 403, 429)


def _status_failure(status: int, data: bytes, ctype: str, rt: EndpointRuntime, ctx: _Ctx,
                    retry_after: str | None) -> Failed:
    if status == 429:
        # The engine's own back-pressure: try another endpoint, do not hold it against this one,
        # and when nothing else can take it, hand the engine's answer through: always with a
        # Retry-After, and with an OpenAI-shaped body (the engine's if it is one, else the router's).
        delay = _retry_after(retry_after)
        err = RouterError(429, f"endpoint {rt.id} is overloaded; retry later", RATE_LIMIT,
                          "upstream_rate_limited", klass="saturated", retry_after=delay)
        if _is_openai_error(data):
            upstream = web.Response(status=429, body=data, headers={
                "Content-Type": "application/json", "X-Request-Id": ctx.rid, "Retry-After": str(delay)})
        else:
            upstream = err.response(ctx.rid)
        return Failed("rate_limited", err, counts=False, upstream=upstream)
    if status in (401, 403):
        return Failed("engine_auth", RouterError(
            502, f"endpoint {rt.id} refused the router's engine key (HTTP {status})", SERVER,
            "upstream_error", klass="upstream_error"))
    # The engine's body (a traceback, paths, its version) stays in the router's log: the client
    # gets the request id to quote, and an operator finds the detail by it.
    log.warning("rid=%s endpoint %s answered HTTP %d: %r", ctx.rid, rt.id, status, error_message(data))
    return Failed("status_5xx", RouterError(
        502, f"endpoint {rt.id} answered HTTP {status} (request id {ctx.rid})", SERVER,
        "upstream_error", klass="upstream_error"))


def _retry_after(value: str | None) -> int:
    """The engine's Retry-After if it is a delay in seconds (RFC 9110 delay-seconds), else 1."""
    if value:
        v = value.strip()
        if v.isascii() and v.isdigit() and len(v) <= 9:
            return int(v)
    return 1


def _is_openai_error(data: bytes) -> bool:
    try:
        obj = json.loads(data)
    except ValueError:
        return False
    return isinstance(obj, dict) and "error" in obj


async def _write_quiet(out: web.StreamResponse, data: bytes) -> None:
    try:
        await out.write(data)
    except (ConnectionError, aiohttp.ClientConnectionError):
        pass
