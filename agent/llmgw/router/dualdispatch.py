"""SGLang's prefill/decode protocol: each try of a request goes to a prefill and a decode endpoint at once.

An SGLang server started with ``--disaggregation-mode decode`` never computes a
prompt itself, and one started with ``prefill`` computes it only for a decoder
that asks. A request names the pair: ``bootstrap_host`` and ``bootstrap_port``
(the prefill server's bootstrap server, which the control plane publishes with
the endpoint) and ``bootstrap_room`` (a random 63-bit id of this transfer). The
same request goes to both at once ("dual dispatch", as SGLang's own router
does): the decoder asks the prefill's bootstrap server for the room, the
prefill server computes the prompt and sends its KV, the decoder generates,
and its answer is the client's. Neither may wait for the other's answer: the
prefill server answers only once the decoder has taken the KV.

So a try is a pair: a prefill endpoint (chosen as for vLLM's two phases, by
what its engine caches, then by load), a fresh room, the prefill request in a
task of its own (not streamed; its answer is read and dropped), and the decode
try run as any other. A prefill that fails before the decoder's first byte (an
error answer, a refused connection, its deadline) leaves the decoder waiting
for KV that never comes, up to SGLang's ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``
(300 s): that decode try is abandoned at once (its connection closed, which
aborts the request in SGLang; not counted against the decoder) and the request
is tried again with another prefill endpoint. A decode try that fails while its
prefill answered is the decoder's own failure and goes elsewhere as any try.
There is no local fallback: where vLLM's decoders prefill a request themselves,
a model whose prefill endpoints are all gone is unavailable (503).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from llmgw.kvbootstrap import bootstrap_fields, new_room

from .context import RequestContext
from .errors import SERVER, RouterError
from .failures import Failed, classify_exception, endpoint_fault, status_failure
from .metrics import RouterMetrics
from .prefill import NO_PREFILL_ENDPOINT, REMOTE, cache_view, prefill_cache
from .runtime import EndpointRuntime, ModelGroup, Routing
from .settings import Disaggregation, RouterSettings
from .upstream import request_whole

log = logging.getLogger("llmgw.router")

BLAME_GRACE = 1.0  # after a failed decode try, how long its prefill may take to say whether it failed too


@dataclass
class Pair:
    """One try's prefill half: its endpoint, room, request task, and the decode try's body."""

    prefill: EndpointRuntime
    room: int
    body: bytes  # the decode try's: the client's request naming the bootstrap and room
    task: "asyncio.Task[Failed | None]"  # the prefill request: None when it answered, else why the pair failed
    decoder_at_fault: bool = False  # the decode try failed while its prefill answered


def paired_bodies(payload: dict[str, Any], fields: dict[str, Any]) -> tuple[bytes, bytes]:
    """(prefill body, decode body): the client's request naming the pair; the prefill's answered whole."""
    decode = {**payload, **fields}
    prefill = {**decode, "stream": False}
    prefill.pop("stream_options", None)
    dumps = json.JSONEncoder(separators=(",", ":")).encode
    return dumps(prefill).encode(), dumps(decode).encode()


def prefill_unavailable(model: str) -> RouterError:
    return RouterError(503, f"no prefill endpoint of model {model!r} can take a request now, and its decode "
                            "engines cannot compute a prompt themselves", SERVER, "prefill_unavailable",
                       klass="unavailable", retry_after=1)


class DualDispatch:
    def __init__(self, settings: RouterSettings, routing: Routing, metrics: RouterMetrics) -> None:
        self.s: Disaggregation = settings.disaggregation
        self.routing = routing
        self.metrics = metrics
        self._running: set[asyncio.Task[Any]] = set()  # prefill requests that outlive their decode try

    def start(self, ctx: RequestContext, group: ModelGroup, target: bytes, payload: dict[str, Any],
              headers: bytes, total_deadline: float, route_payload: dict[str, Any] | None,
              tried: set[str]) -> Pair | None:
        """Send one try's prefill request and return its pair; None: no prefill endpoint can take it.

        ``tried``: the prefill endpoints this request used already (each try takes another while any is left)."""
        pgroup = group.prefill
        if pgroup is None:
            return None
        by_cache = prefill_cache(cache_view(self.routing.scorer, group.model), route_payload)
        rt = self.routing.pick_prefill(pgroup, tried, by_cache)
        if rt is None:
            return None
        tried.add(rt.id)
        port = rt.endpoint.bootstrap_port
        assert port is not None  # a dual group's prefill endpoints name their bootstrap (runtime._dual)
        self.metrics.prefill_picks.labels(group.model, "cache" if by_cache is not None and by_cache[0](rt)
                                          else "load").inc()
        room = new_room()
        pbody, dbody = paired_bodies(payload, bootstrap_fields(rt.endpoint.url, port, room))
        loop = asyncio.get_running_loop()
        deadline = min(loop.time() + self.s.prefill_timeout, total_deadline)
        task = loop.create_task(self._prefill(ctx, group.model, pgroup, rt, target, pbody, headers, deadline),
                                name=f"prefill {ctx.rid}")
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return Pair(rt, room, dbody, task)

    def count(self, model: str, remote: bool) -> None:
        """One decision per request: every request of such a model is prefilled remotely, or cannot be."""
        self.metrics.prefill_decisions.labels(model, REMOTE if remote else NO_PREFILL_ENDPOINT).inc()

    async def run(self, ctx: RequestContext, decode: Awaitable[web.StreamResponse | Failed],
                  pair: Pair) -> web.StreamResponse | Failed:
        """The decode try beside its prefill: its result, or the prefill's failure when that came first."""
        attempt = asyncio.ensure_future(decode)
        try:
            await asyncio.wait({attempt, pair.task}, return_when=asyncio.FIRST_COMPLETED)
            if not attempt.done():
                failed = pair.task.result()
                if failed is None or ctx.status:  # it answered, or the decoder already answers the client
                    return await attempt
                ctx.abandoned = True
                attempt.cancel()
                await asyncio.wait({attempt})
                ctx.abandoned = False
                if not attempt.cancelled() and attempt.exception() is None:
                    result = attempt.result()
                    if not isinstance(result, Failed):  # it answered meanwhile after all
                        return result
                log.warning("rid=%s prefill on %s (room %d) failed before the decoder's first byte: %s; "
                            "decode try abandoned", ctx.rid, pair.prefill.id, pair.room, failed.error.message)
                return failed
            result = attempt.result()
            if isinstance(result, Failed):
                pair.decoder_at_fault = await self._prefill_answered(pair)
            return result
        except BaseException:
            attempt.cancel()
            pair.task.cancel()
            raise

    async def _prefill_answered(self, pair: Pair) -> bool:
        """After a failed decode try: whether its prefill answered (else the pair failed, not the decoder)."""
        if not pair.task.done():
            await asyncio.wait({pair.task}, timeout=BLAME_GRACE)
        if not pair.task.done():
            pair.task.cancel()
            return False
        return not pair.task.cancelled() and pair.task.exception() is None and pair.task.result() is None

    async def _prefill(self, ctx: RequestContext, model: str, pgroup: ModelGroup, rt: EndpointRuntime,
                       target: bytes, body: bytes, headers: bytes, deadline: float) -> Failed | None:
        """The prefill request: None when it answered 200, else the pair's failure (recorded against ``rt``)."""
        started = time.monotonic()
        outcome = "failed"
        rt.outstanding += 1
        try:
            try:
                head, data = await request_whole(rt.get_pool(), target, headers, body, deadline)
            except asyncio.CancelledError:
                self.routing.record(rt, pgroup, "cancelled", failure=False)
                outcome = "cancelled"
                raise
            except Exception as e:  # noqa: BLE001 - classified; an unknown one (a bug) is raised again
                failed = classify_exception(e, rt, "prefill timeout")
                self.routing.record(rt, pgroup, failed.outcome, failure=failed.counts)
                return _pair_failed(failed, rt)
            if endpoint_fault(head.status):
                failed = status_failure(head.status, data, rt, ctx.rid, head.headers.get("retry-after"))
                self.routing.record(rt, pgroup, failed.outcome, failure=failed.counts)
                return _pair_failed(failed, rt)
            if head.status >= 400:  # the client's request: answered as the engine answered it, not tried again
                self.routing.record(rt, pgroup, "client_error", failure=False)
                outcome = "client_error"
                answer = web.Response(status=head.status, body=data, headers={
                    "Content-Type": head.headers.get("content-type", "application/json"), "X-Request-Id": ctx.rid})
                return Failed("client_error", RouterError(head.status, "refused by the prefill engine", SERVER),
                              counts=False, retryable=False, upstream=answer)
            self.routing.record(rt, pgroup, "ok", failure=False)
            outcome = "ok"
            return None
        finally:
            rt.outstanding -= 1
            self.metrics.prefill.labels(model, outcome).inc()
            self.metrics.prefill_seconds.labels(model).observe(time.monotonic() - started)

    async def close(self) -> None:
        """Shutdown: prefill requests still running are cancelled."""
        tasks = list(self._running)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


def _pair_failed(failed: Failed, rt: EndpointRuntime) -> Failed:
    """The pair's failure for the retry loop: the prefill's error, tried again with another pair."""
    return Failed("prefill", RouterError(502, f"prefill endpoint {rt.id} failed: {failed.error.message}", SERVER,
                                         "prefill_failed", klass="upstream_error"),
                  counts=False, retryable=True)
