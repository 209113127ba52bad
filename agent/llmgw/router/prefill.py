"""The prefill phase of a disaggregated model: a remote prefill before the request goes to a decoder.

A model whose endpoints include some with ``role: prefill`` is served in two
phases, as vLLM's NixlConnector expects (``llmgw.kvtransfer``): the request
goes first to a prefill endpoint with ``kv_transfer_params`` asking it to hold
the prompt's KV blocks for a remote decoder (``stream`` false, ``max_tokens``
1), and its answer's ``kv_transfer_params`` go verbatim on the original request
to a decode endpoint, whose connector pulls the blocks instead of computing
them. The decode side is the model's ordinary group (``decode`` and ``both``
endpoints), balanced, retried and ejected as any model's.

Disaggregation never costs the client a request: a prefill that fails (an
engine error, a timeout, an answer the decoder could not use) is tried once
more on another prefill endpoint, and after that the request goes to the
decoder as it came, which prefills it itself. Short prompts skip the remote
prefill (``disaggregation.min_prompt_bytes``): the transfer costs more than
computing them where they will be decoded. A decode that fails before its
first byte is retried without the parameters (the blocks may be gone).
Prefill endpoints are ejected on their own failures, as a group of their own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from llmgw import compat
from llmgw.kvtransfer import PREFILL_REQUEST, check_prefill_params

from .context import RequestContext
from .failures import classify_exception, endpoint_fault, status_failure
from .metrics import RouterMetrics
from .runtime import ModelGroup, Routing
from .settings import RouterSettings
from .upstream import Connection

log = logging.getLogger("llmgw.router")

_PATHS = (b"/v1/completions", b"/v1/chat/completions")
TRIES = 2  # prefill endpoints tried before the decoder prefills itself


def prefill_body(payload: dict[str, Any]) -> bytes:
    """The prefill phase's request: the client's, not streamed, one token, blocks held for a decoder."""
    req = {**payload, "stream": False, "max_tokens": 1, "kv_transfer_params": dict(PREFILL_REQUEST)}
    req.pop("stream_options", None)
    if "max_completion_tokens" in req:
        req["max_completion_tokens"] = 1
    return json.dumps(req, separators=(",", ":")).encode()


def decode_body(payload: dict[str, Any], params: dict[str, Any]) -> bytes:
    """The client's request carrying the prefill's ``kv_transfer_params``, as it answered them."""
    return json.dumps({**payload, "kv_transfer_params": params}, separators=(",", ":")).encode()


class Prefill:
    def __init__(self, settings: RouterSettings, routing: Routing, metrics: RouterMetrics) -> None:
        self.s = settings.disaggregation
        self.routing = routing
        self.metrics = metrics

    def wanted(self, group: ModelGroup, target: bytes, body: bytes, payload: dict[str, Any]) -> bool:
        """Whether this request gets a remote prefill: a disaggregated model, a completion, a long prompt."""
        return (group.prefill is not None and len(body) >= self.s.min_prompt_bytes
                and target.split(b"?", 1)[0] in _PATHS and "kv_transfer_params" not in payload)

    async def params(self, ctx: RequestContext, group: ModelGroup, target: bytes, payload: dict[str, Any],
                     headers: bytes, total_deadline: float) -> dict[str, Any] | None:
        """The decoder's ``kv_transfer_params`` from a prefill endpoint; None: the decoder prefills."""
        pgroup = group.prefill
        assert pgroup is not None
        loop = asyncio.get_running_loop()
        body = prefill_body(payload)
        tried: set[str] = set()
        started = time.monotonic()
        outcome = "fallback"
        try:
            for _ in range(TRIES):
                rt = self.routing.pick_prefill(pgroup, tried)
                if rt is None:
                    outcome = "fallback" if tried else "unavailable"
                    return None
                tried.add(rt.id)
                deadline = min(loop.time() + self.s.prefill_timeout, total_deadline)
                rt.outstanding += 1
                conn: Connection | None = None
                try:
                    async with compat.timeout_at(deadline):
                        conn = await rt.get_pool().request(target, headers, body)
                        data = await conn.read_all()
                    head = conn.head
                    conn.release()
                except asyncio.CancelledError:
                    if conn is not None:
                        conn.close()
                    raise
                except Exception as e:  # noqa: BLE001 - classified; an unknown one (a bug) is raised again
                    if conn is not None:
                        conn.close()
                    failed = classify_exception(e, rt, "prefill timeout")
                    self.routing.record(rt, pgroup, failed.outcome, failure=failed.counts)
                    log.warning("rid=%s prefill on %s failed: %s", ctx.rid, rt.id, failed.error)
                    continue
                finally:
                    rt.outstanding -= 1
                if endpoint_fault(head.status):
                    failed = status_failure(head.status, data, rt, ctx.rid, head.headers.get("retry-after"))
                    self.routing.record(rt, pgroup, failed.outcome, failure=failed.counts)
                    continue
                if head.status >= 400:  # the client's request: the decoder will answer it the same
                    self.routing.record(rt, pgroup, "client_error", failure=False)
                    return None
                params, why = _params(head.status, data)
                if params is None:
                    # the engine answered, but nothing a decoder can use: its fault, not the client's
                    self.routing.record(rt, pgroup, "bad_prefill", failure=True)
                    log.warning("rid=%s prefill on %s: %s", ctx.rid, rt.id, why)
                    continue
                self.routing.record(rt, pgroup, "ok", failure=False)
                outcome = "ok"
                return params
            return None
        finally:
            self.metrics.prefill.labels(group.model, outcome).inc()
            self.metrics.prefill_seconds.labels(group.model).observe(time.monotonic() - started)


def _params(status: int, data: bytes) -> tuple[dict[str, Any] | None, str]:
    """The prefill answer's ``kv_transfer_params``, or None and why they cannot go to a decoder."""
    if status != 200:
        return None, f"HTTP {status}"
    try:
        params = json.loads(data).get("kv_transfer_params")
    except (ValueError, AttributeError):
        return None, "the answer is not a JSON object"
    problems = check_prefill_params(params)
    if problems:
        return None, "; ".join(problems)
    return params, ""
