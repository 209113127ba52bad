"""``POST /v1/router/wake``: a router holds requests for a sleeping model and asks for its wake.

Scale to sleep (docs/autoscaling.md): a router whose endpoints for a model
are all asleep holds the model's requests (``router/holdqueue.py``) and
asks here, at most once a second per model and worker.  Only a router
certificate may ask (an operator or a node has no request to hold); the
router is named by its certificate, and each router is held to a token
bucket, so a runaway one is answered 429 and hurts only itself.  What a
router can make happen here is bounded: the replicas of a deployment with
``autoscale.sleep`` wake, as they would for one request; nothing is placed
or stopped.  A malformed body is refused with its JSON pointer.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from aiohttp import web

from llmgw.config import schema_errors
from llmgw.controlplane.ejections_api import TokenBucket
from llmgw.controlplane.state import ControlPlane

log = logging.getLogger("llmgw.controlplane")

__all__ = ["WakeAPI"]

BURST = 50.0  # wakes a router may ask for at once (one per model and worker)
REFILL = 10.0  # wakes per second a router may keep asking for
MAX_BODY = 4096


class WakeAPI:
    def __init__(self, cp: ControlPlane, router_name: Callable[[web.Request], str | None]):
        self.cp = cp
        self.router_name = router_name
        self.budgets: dict[str, TokenBucket] = {}

    async def handle(self, request: web.Request) -> web.Response:
        router = self.router_name(request)
        if router is None:
            log.warning("refused %s %s from %s: not a router certificate", request.method, request.path,
                        request.remote)
            return web.json_response({"error": "only a router certificate may ask for a wake"}, status=403)
        now = self.cp.clock()
        bucket = self.budgets.get(router) or self.budgets.setdefault(router, TokenBucket(BURST, REFILL, BURST, now))
        if not bucket.take(now):
            return web.json_response({"error": f"router {router!r} asks for wakes too often (at most {REFILL:g}/s)"},
                                     status=429, headers={"Retry-After": "1"})
        if request.content_length is not None and request.content_length > MAX_BODY:
            return web.json_response({"error": f"the body is larger than {MAX_BODY} bytes"}, status=413)
        try:
            body = await request.read()  # the listener caps every body (client_max_size)
            if len(body) > MAX_BODY:
                return web.json_response({"error": f"the body is larger than {MAX_BODY} bytes"}, status=413)
            doc = json.loads(body)
        except (ValueError, RecursionError) as e:
            return web.json_response({"error": f"the body is not JSON: {e}"}, status=400)
        errors = schema_errors(doc, "router-wake", limit=5)
        if errors:
            return web.json_response({"error": "invalid wake request",
                                      "errors": [{"pointer": e.pointer, "message": e.message} for e in errors]},
                                     status=400)
        waking = self.cp.wake_model(doc["model"])
        if waking:
            log.info("router %r holds requests for %s: waking it", router, doc["model"])
        return web.json_response({"waking": waking}, status=202)
