"""What an engine's failure, or a request the router cannot serve, means: to the client and to the endpoint.

Pure classification, no I/O.  An attempt that fails before the commit point
becomes a ``Failed``: the outcome it is counted under, whether it counts
against the endpoint (outlier ejection) and may be retried elsewhere, and
the OpenAI-shaped error the client gets if nothing else can serve it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from aiohttp import web

from .errors import INVALID_REQUEST, RATE_LIMIT, SERVER, RouterError
from .http1 import ProtocolError
from .runtime import EndpointRuntime
from .sse import error_message
from .upstream import ConnectError, UpstreamError

log = logging.getLogger("llmgw.router")

UPSTREAM_ERRORS = (UpstreamError, ProtocolError, OSError)  # the engine connection failed

# Agents re-register within seconds of a control-plane restart; the grace is only the bound on
# how long that may take, so clients are told to come back soon rather than when it ends.
PENDING_RETRY_AFTER = 2


@dataclass
class Failed:
    """An attempt that failed before the commit point."""

    outcome: str  # attempts metric label
    error: RouterError  # what the client gets if no retry happens
    counts: bool = True  # against the endpoint's health
    retryable: bool = True
    upstream: web.Response | None = None  # pass-through answer (upstream 429)


def model_not_found(model: str) -> RouterError:
    # OpenAI's wording and shape, for unknown models and models the key may not use alike
    return RouterError(404, f"The model `{model}` does not exist or you do not have access to it.",
                       INVALID_REQUEST, "model_not_found", klass="model_not_found")


def model_not_ready(model: str, left: float) -> RouterError:
    """A model the table may not list yet: ``left`` seconds until it can be trusted to."""
    return RouterError(503, f"model `{model}` is not available yet: the control plane has just started and "
                            f"its engines are still reporting; retry in a few seconds",
                       SERVER, "model_not_ready", klass="unavailable",
                       retry_after=min(int(left) + 1, PENDING_RETRY_AFTER))


def too_large(limit: int) -> RouterError:
    return RouterError(413, f"request body exceeds the limit of {limit} bytes", INVALID_REQUEST,
                       "request_too_large", klass="too_large")


def total_timeout(rt: EndpointRuntime) -> Failed:
    """The request's own deadline fired, not the engine's per-try/first-token one: not its fault."""
    return Failed("timeout", RouterError(
        504, f"total request timeout reached while waiting for endpoint {rt.id}", SERVER,
        "upstream_timeout", klass="upstream_timeout"), counts=False, retryable=False)


def classify_exception(e: BaseException, rt: EndpointRuntime, timeout_what: str) -> Failed:
    """The failure an attempt's exception is; an unknown one (a bug) is raised again."""
    if isinstance(e, ConnectError):
        return Failed("connect", RouterError(
            502, f"cannot connect to endpoint {rt.id}: {e.reason}", SERVER, "upstream_connect_error",
            klass="upstream_error"))
    if isinstance(e, TimeoutError):
        return Failed("timeout", RouterError(
            504, f"endpoint {rt.id}: {timeout_what}", SERVER, "upstream_timeout", klass="upstream_timeout"))
    if isinstance(e, UPSTREAM_ERRORS):
        return Failed("broken", RouterError(
            502, f"endpoint {rt.id} dropped the connection: {type(e).__name__}", SERVER,
            "upstream_disconnected", klass="upstream_error"))
    raise e


def endpoint_fault(status: int) -> bool:
    """An answer that says something about the endpoint, not the client's request.

    401/403 from an engine means it refused the router's engine key (a key
    rotated by a replacement the router has not heard of yet): the client did
    nothing wrong, another replica can serve it, and passing "Unauthorized"
    through would make the client doubt its own router key.
    """
    return status >= 500 or status in (401, 403, 429)


def status_failure(status: int, data: bytes, rt: EndpointRuntime, rid: str, retry_after: str | None) -> Failed:
    """The failure an answer is for which ``endpoint_fault`` holds."""
    if status == 429:
        # The engine's own back-pressure: try another endpoint, do not hold it against this one,
        # and when nothing else can take it, hand the engine's answer through: always with a
        # Retry-After, and with an OpenAI-shaped body (the engine's if it is one, else the router's).
        delay = retry_delay(retry_after)
        err = RouterError(429, f"endpoint {rt.id} is overloaded; retry later", RATE_LIMIT,
                          "upstream_rate_limited", klass="saturated", retry_after=delay)
        if is_openai_error(data):
            upstream = web.Response(status=429, body=data, headers={
                "Content-Type": "application/json", "X-Request-Id": rid, "Retry-After": str(delay)})
        else:
            upstream = err.response(rid)
        return Failed("rate_limited", err, counts=False, upstream=upstream)
    if status in (401, 403):
        return Failed("engine_auth", RouterError(
            502, f"endpoint {rt.id} refused the router's engine key (HTTP {status})", SERVER,
            "upstream_error", klass="upstream_error"))
    # The engine's body (a traceback, paths, its version) stays in the router's log: the client
    # gets the request id to quote, and an operator finds the detail by it.
    log.warning("rid=%s endpoint %s answered HTTP %d: %r", rid, rt.id, status, error_message(data))
    return Failed("status_5xx", RouterError(
        502, f"endpoint {rt.id} answered HTTP {status} (request id {rid})", SERVER,
        "upstream_error", klass="upstream_error"))


def retry_delay(value: str | None) -> int:
    """The engine's Retry-After if it is a delay in seconds (RFC 9110 delay-seconds), else 1."""
    if value:
        v = value.strip()
        if v.isascii() and v.isdigit() and len(v) <= 9:
            return int(v)
    return 1


def is_openai_error(data: bytes) -> bool:
    try:
        obj = json.loads(data)
    except ValueError:
        return False
    return isinstance(obj, dict) and "error" in obj
