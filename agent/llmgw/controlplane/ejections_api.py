"""``POST /v1/router/ejections``: routers report the engines they ejected.

Only a router certificate may report (an operator or a node has no
business claiming what a router saw); the report names its router by the
certificate, never by anything in the body, so one router cannot speak for
another.  Each router is held to a token bucket: a router with many
workers reports once per worker every two seconds, far below it, and a
runaway one is answered 429 and hurts only itself.  A malformed body is
refused with every error and its JSON pointer, and changes nothing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from llmgw.config import schema_errors
from llmgw.controlplane.state import ControlPlane
from llmgw.router.ejectreport import EJECTIONS_PATH

log = logging.getLogger("llmgw.controlplane.ejections")

__all__ = ["EJECTIONS_PATH", "EjectionsAPI", "TokenBucket"]

BURST = 20.0  # reports a router may send at once
REFILL = 2.0  # reports per second a router may keep sending
MAX_ERRORS = 20  # a refusal names this many problems at most


@dataclass
class TokenBucket:
    capacity: float
    rate: float
    tokens: float
    at: float

    def take(self, now: float) -> bool:
        self.tokens = min(self.capacity, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class EjectionsAPI:
    def __init__(self, cp: ControlPlane, router_name: Callable[[web.Request], str | None]):
        self.cp = cp
        self.router_name = router_name
        self.buckets: dict[str, TokenBucket] = {}

    async def handle(self, request: web.Request) -> web.Response:
        router = self.router_name(request)
        if router is None:
            log.warning("refused %s %s from %s: not a router certificate", request.method, request.path,
                        request.remote)
            return web.json_response({"error": "only a router certificate may report ejections"}, status=403)
        now = self.cp.clock()
        bucket = self.buckets.setdefault(router, TokenBucket(BURST, REFILL, BURST, now))
        if not bucket.take(now):
            return web.json_response({"error": f"router {router!r} reports too often (at most {REFILL:g}/s)"},
                                     status=429, headers={"Retry-After": "1"})
        try:
            doc = json.loads(await request.read())
        except (ValueError, RecursionError) as e:
            return web.json_response({"error": f"the body is not JSON: {e}"}, status=400)
        errors = schema_errors(doc, "router-ejections", limit=MAX_ERRORS)
        if errors:
            log.warning("refused an ejection report from router %r: %s", router, "; ".join(map(str, errors)))
            return web.json_response({"error": "invalid ejection report",
                                      "errors": [{"pointer": e.pointer, "message": e.message} for e in errors]},
                                     status=400)
        self.cp.router_report(router, doc["ejections"], doc.get("instance", ""))
        return web.json_response({"accepted": len(doc["ejections"])}, status=202)
