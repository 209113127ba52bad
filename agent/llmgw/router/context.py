"""What one request's handling learned, and its accounting when it ends: metrics and the access log.

Every answer on the OpenAI paths, refusals and the router's own errors
included, is counted and logged once, from this record, however the
handling ended.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from aiohttp import web

from .metrics import RouterMetrics

access_log = logging.getLogger("llmgw.router.access")


class RequestContext:
    __slots__ = ("rid", "t0", "t0_loop", "model", "model_label", "key", "status", "endpoint", "attempts", "ttft",
                 "admitted", "note", "delivered", "out", "limits", "cache", "abandoned")

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
        # when the request was let through to its first upstream try (perf_counter): after the body's
        # read, a hold for a waking model, a limited key's admission (which may wait for an allowance)
        self.admitted: float | None = None
        self.note = ""
        self.delivered = False  # a stream relayed whole, [DONE] included
        self.out: web.StreamResponse | None = None  # the client's stream, once the relay started
        self.limits: Any = None  # a limited key's reservation and headers (limitsgate.Limited)
        self.cache: Any = None  # a cache-aware model's predicted and reported hits (cachehits.CacheProbe)
        # the try being cancelled is given up by the router (its SGLang prefill failed), not by the client:
        # its engine is not watched for a verdict (router/dualdispatch.py)
        self.abandoned = False


def account(ctx: RequestContext, request: web.Request, metrics: RouterMetrics, log_access: bool) -> None:
    """Count the finished request and, when ``log_access``, write its access-log line."""
    dur = time.perf_counter() - ctx.t0
    metrics.request_done(ctx.model_label, ctx.status, dur)
    if log_access:
        access_log.info(
            'rid=%s key=%s "%s %s" model=%s status=%d endpoint=%s attempts=%d ttft_ms=%s dur_ms=%.1f wait_ms=%s%s',
            ctx.rid, ctx.key, request.method, request.path, ctx.model or "-", ctx.status,
            ctx.endpoint or "-", ctx.attempts,
            f"{(ctx.ttft * 1000):.1f}" if ctx.ttft is not None else "-", dur * 1000,
            f"{(ctx.admitted - ctx.t0) * 1000:.1f}" if ctx.admitted is not None else "-",
            f" note={ctx.note}" if ctx.note else "")
