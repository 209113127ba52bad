"""``POST /v1/router/load``: each worker of a standalone router reports its requests in flight per replica.

The autoscaler's signal where clients do not go through the control plane's
own router (``controlplane/routerload``).  Only a router certificate may
report (the router is named by it, never by the body), each router at
``REFILL`` reports a second per worker it has been seen to run (a worker
sends one a second), and a malformed body is refused with its JSON pointers
and changes nothing: the checks every router route makes
(``controlplane/routerposts``).  What a router can make happen is bounded by
what its clients could: it can only claim requests in flight to replicas,
which at most raises counts within each deployment's ``max``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from aiohttp import web

from llmgw.controlplane.routerposts import RouterPost, RouterPosts
from llmgw.controlplane.state import ControlPlane

log = logging.getLogger("llmgw.controlplane")

__all__ = ["LoadAPI"]

BURST = 5.0  # reports a worker may send at once (a control plane that stalled, then the backlog)
REFILL = 2.0  # reports per second a worker may keep sending (it sends one)
# 4,096 replicas (the most a report names) with ids of up to about 50 characters, as llmgw makes them
# (model.profile.slot-suffix); a router whose busiest 4,096 have longer ids is refused 413 (docs/autoscaling.md)
MAX_BODY = 256 * 1024


class LoadAPI:
    def __init__(self, cp: ControlPlane, router_name: Callable[[web.Request], str | None]):
        self.cp = cp
        self.posts = RouterPosts(router_name, schema="router-load", what="report load", noun="load report",
                                 burst=BURST, refill=REFILL, log=log, max_body=MAX_BODY)

    async def handle(self, request: web.Request) -> web.Response:
        got = await self.posts.read(request, self.cp.clock())
        if not isinstance(got, RouterPost):
            return got
        doc = got.doc
        self.cp.router_load.report(got.router, doc["instance"], doc["outstanding"], self.cp.clock())
        return web.json_response({"accepted": len(doc["outstanding"])}, status=202)
