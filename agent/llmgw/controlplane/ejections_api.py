"""``POST /v1/router/ejections``: routers report the engines they ejected.

Only a router certificate may report (an operator or a node has no
business claiming what a router saw), each router at ``REFILL`` reports a
second per worker it has been seen to run (every worker reports on its own
every two seconds), and a malformed body is refused with its JSON pointers
and changes nothing: the checks every router route makes
(``controlplane/routerposts``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from aiohttp import web

from llmgw.controlplane.routerposts import RouterPost, RouterPosts
from llmgw.controlplane.state import ControlPlane

log = logging.getLogger("llmgw.controlplane.ejections")

__all__ = ["BURST", "REFILL", "EjectionsAPI"]

BURST = 20.0  # reports a router may send at once, per worker seen
REFILL = 2.0  # reports per second a router may keep sending, per worker seen (a worker sends one every 2 s)


class EjectionsAPI:
    def __init__(self, cp: ControlPlane, router_name: Callable[[web.Request], str | None]):
        self.cp = cp
        self.posts = RouterPosts(router_name, schema="router-ejections", what="report ejections",
                                 noun="ejection report", burst=BURST, refill=REFILL, log=log)

    async def handle(self, request: web.Request) -> web.Response:
        got = await self.posts.read(request, self.cp.clock())
        if not isinstance(got, RouterPost):
            return got
        doc = got.doc
        self.cp.router_report(got.router, doc["ejections"], doc.get("instance", ""))
        return web.json_response({"accepted": len(doc["ejections"])}, status=202)
