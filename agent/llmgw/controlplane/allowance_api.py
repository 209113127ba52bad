"""``POST /v1/router/allowance``: router workers return and lease slices of per-key limits.

Only a router certificate may lease, at a bounded rate per worker, with a
body valid against its schema (the checks every router route makes,
``controlplane/routerposts``): the holder of a lease is the certificate's
name and the worker ``instance`` of the body, so one router can neither
return nor spend another's slices.  The rate is generous (a worker near a
key's limit exchanges about once a request): it bounds a runaway router's
books, not an honest one's traffic.  While the books are new (for one lease
time after this control plane starts or takes the lead) the answer is 503
with ``Retry-After``, like every other route a router cannot use yet; with
``ha`` a standby never gets here (``standby.standby_gate`` answers for it).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from aiohttp import web

from llmgw.controlplane.allowance import AllowanceBook, Ask, Denial, Return
from llmgw.controlplane.routerposts import RouterPost, RouterPosts
from llmgw.controlplane.state import ControlPlane

log = logging.getLogger("llmgw.controlplane.allowance")

__all__ = ["AllowanceAPI"]

BURST = 200.0  # exchanges a worker may make at once
REFILL = 100.0  # exchanges a second a worker may keep making


class AllowanceAPI:
    def __init__(self, cp: ControlPlane, router_name: Callable[[web.Request], str | None]):
        self.cp = cp
        self.posts = RouterPosts(router_name, schema="router-allowance", what="lease allowances",
                                 noun="allowance request", burst=BURST, refill=REFILL, log=log)
        self.book = AllowanceBook(cp.settings.router_allowance.lease_seconds, cp.clock())
        self.epoch = cp.leader_epoch

    async def handle(self, request: web.Request) -> web.Response:
        got = await self.posts.read(request, self.cp.clock())
        if not isinstance(got, RouterPost):
            return got
        router, doc = got.router, got.doc
        now = self.cp.clock()
        if self.cp.leader_epoch != self.epoch:  # a new term: the old leader's books are not ours
            self.epoch = self.cp.leader_epoch
            self.book.restart(now)
        status, answer = exchange(self.book, (router, doc["instance"]), doc, now)
        headers = {"Retry-After": str(math.ceil(answer["retry_after"]))} if status == 503 else None
        return web.json_response(answer, status=status, headers=headers)


def exchange(book: AllowanceBook, holder: tuple[str, str], doc: dict, now: float) -> tuple[int, dict]:
    """Apply a valid request's returns, then its asks: (HTTP status, answer)."""
    book.settle(holder, [Return(r["lease"], r["unused"], float(r["idle"])) for r in doc.get("returns", ())], now)
    asks = doc.get("asks", ())
    if not asks:
        return 200, {"answers": []}
    left = book.holding(now)
    if left > 0:
        return 503, {"error": f"allowance books are new: grants start in {left:.1f}s (leases of an earlier "
                              "control plane end by then)", "retry_after": left}
    got = book.grant(holder, [Ask(a["key"], a["scope"], a["dimension"], a["limit"], float(a["span"]), a["need"],
                                  a.get("held", 0)) for a in asks], now)
    out = []
    for g in got:
        if isinstance(g, Denial):
            out.append({"retry_after": None if math.isinf(g.retry_after) else round(g.retry_after, 3),
                        "limit": g.limit, "reset": round(g.reset, 3)})
        else:
            grant = {"lease": g.lease, "amount": g.amount, "ttl": g.ttl, "remaining": g.remaining,
                     "reset": round(g.reset, 3)}
            if g.retry_after is not None:  # concurrency slots kept, but no more to be had
                grant["retry_after"] = round(g.retry_after, 3)
            out.append(grant)
    return 200, {"answers": out}
