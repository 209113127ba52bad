"""``POST /v1/router/wake``: a router holds requests for a sleeping model and asks for its wake.

A router with no endpoint left of a model that scales from zero asks the
same, with the number it holds (``held``): that is the demand that starts
the deployment's first replica (``controlplane/autoscale_zero.py``).

Scale to sleep (docs/autoscaling.md): a router whose endpoints for a model
are all asleep holds the model's requests (``router/holdqueue.py``) and
asks here, at most once a second per model and worker.  Only a router
certificate may ask (an operator or a node has no request to hold), at a
bounded rate per worker, with a body valid against its schema (the checks
every router route makes, ``controlplane/routerposts``), so a runaway router
is answered 429 and hurts only itself.  What a
router can make happen here is bounded: the replicas of a deployment with
``autoscale.sleep`` wake, as they would for one request, and a deployment
at zero counts the requests held as its demand for a few seconds (bounded
by the schema; the autoscaler's ``max`` bounds what any demand can place);
nothing is stopped.  A malformed body is refused with its JSON pointer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from aiohttp import web

from llmgw.controlplane.routerposts import RouterPost, RouterPosts
from llmgw.controlplane.state import ControlPlane

log = logging.getLogger("llmgw.controlplane")

__all__ = ["WakeAPI"]

BURST = 50.0  # wakes a worker may ask for at once (one per model)
REFILL = 10.0  # wakes per second a worker may keep asking for
MAX_BODY = 4096


class WakeAPI:
    def __init__(self, cp: ControlPlane, router_name: Callable[[web.Request], str | None]):
        self.cp = cp
        self.posts = RouterPosts(router_name, schema="router-wake", what="ask for a wake", noun="wake request",
                                 burst=BURST, refill=REFILL, log=log, max_body=MAX_BODY)

    async def handle(self, request: web.Request) -> web.Response:
        got = await self.posts.read(request, self.cp.clock())
        if not isinstance(got, RouterPost):
            return got
        router, doc = got.router, got.doc
        waking = self.cp.wake_model(doc["model"], doc.get("held"), router)
        if waking:
            log.info("router %r holds requests for %s: waking it", router, doc["model"])
        return web.json_response({"waking": waking}, status=202)
