"""One try of a request on one endpoint, up to the commit point, and what the engine did with it.

Nothing reaches the client before the engine produced its first token (for
streams) or its whole answer (otherwise): until then a failure is returned
as a ``Failed`` (``failures.py``) for the retry loop (``forward.py``) to try
elsewhere.  A stream that commits is handed to the relay.  Every attempt's
outcome is recorded against its endpoint exactly once: an attempt whose
client left before the first token is watched to its first-token deadline
by a verdict task, so a hung engine is still found out.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from llmgw import compat

from .context import RequestContext
from .errors import SERVER, RouterError
from .failures import UPSTREAM_ERRORS, Failed, classify_exception, endpoint_fault, status_failure, total_timeout
from .http1 import Head
from .relay import Relay
from .runtime import EndpointRuntime, ModelGroup, Routing
from .sse import ERROR_MARK, EventBuffer, Kind, error_message, event_data, first_error, first_output
from .upstream import Connection

_ERROR_BODY_LIMIT = 64 * 1024


class Attempts:
    def __init__(self, routing: Routing, relay: Relay) -> None:
        self.routing = routing
        self.relay = relay
        # attempts whose client left before the first token, still watched for the engine's verdict
        self.verdicts: set[asyncio.Task] = set()
        self._closing = False

    async def close(self) -> None:
        """Shutdown: stop watching abandoned attempts (their connections are closed)."""
        self._closing = True
        tasks = list(self.verdicts)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def plain(self, ctx: RequestContext, rt: EndpointRuntime, group: ModelGroup, target: bytes,
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
            return self._failed(e, rt, group, "per-try timeout", deadline >= total_deadline)
        head = conn.head
        conn.release()
        return self._whole(ctx, rt, group, head, data, head.headers.get("content-type", "application/json"))

    def _whole(self, ctx: RequestContext, rt: EndpointRuntime, group: ModelGroup, head: Head, data: bytes,
               ctype: str) -> web.Response | Failed:
        """A whole answer (not a stream): the client's, or a failure when it speaks of the endpoint."""
        status = head.status
        if endpoint_fault(status):
            failed = status_failure(status, data, rt, ctx.rid, head.headers.get("retry-after"))
            self.routing.record(rt, group, failed.outcome, failure=failed.counts)
            return failed
        self.routing.record(rt, group, "ok" if status < 400 else "client_error", failure=False)
        ctx.status = status
        return web.Response(status=status, body=data, headers={"Content-Type": ctype, "X-Request-Id": ctx.rid})

    async def stream(self, request: web.Request, ctx: RequestContext, rt: EndpointRuntime, group: ModelGroup,
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
                    return self._whole(ctx, rt, group, head, data, ctype or "application/json")
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
            if conn is not None and not conn.closed and not ctx.abandoned:
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
            return self._failed(e, rt, group, "no first token within the first-token timeout"
                                if resp is not None else "per-try timeout", pre_deadline >= total_deadline,
                                "first_token_timeout" if resp is not None else "timeout")
        return await self.relay.relay(request, ctx, rt, group, resp, buf, held, total_deadline)

    def _failed(self, e: BaseException, rt: EndpointRuntime, group: ModelGroup, timeout_what: str, by_total: bool,
                timeout_outcome: str = "timeout") -> Failed:
        """Classify and record an attempt that raised; unknown exceptions are recorded and re-raised."""
        if by_total and isinstance(e, TimeoutError):
            failed = total_timeout(rt)
        else:
            try:
                failed = classify_exception(e, rt, timeout_what)
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
        self.verdicts.add(task)
        task.add_done_callback(self.verdicts.discard)

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
        except UPSTREAM_ERRORS:
            outcome, failure = "broken", True
        finally:
            conn.close()
            rt.outstanding -= 1
            self.routing.record(rt, group, outcome, failure=failure)
