"""``POST /v1/router/ejections``: routers report the engines they ejected.

Only a router certificate may report (an operator or a node has no
business claiming what a router saw); the report names its router by the
certificate, never by anything in the body, so one router cannot speak for
another.  Each router is held to a token bucket that grows with the worker
processes it has been seen to run (distinct ``instance`` values of valid
reports lately, up to ``MAX_WORKERS``): every worker reports on its own
every two seconds, so a budget per router name alone refused most reports
of a router with many workers, while a runaway one is answered 429 and
hurts only itself.  A malformed body is refused with every error and its
JSON pointer, and changes nothing; so is a number that is not a finite,
plausible one (``NaN``, ``Infinity``, 400 digits), which JSON Schema's
bounds let through.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from llmgw.config import schema_errors
from llmgw.controlplane.state import ControlPlane

log = logging.getLogger("llmgw.controlplane.ejections")

__all__ = ["EjectionsAPI", "TokenBucket"]

BURST = 20.0  # reports a router may send at once, per worker seen
REFILL = 2.0  # reports per second a router may keep sending, per worker seen (a worker sends one every 2 s)
MAX_WORKERS = 64  # workers of one router that widen its budget; more count as these
WORKER_TTL = 60.0  # a worker not heard from for this long no longer widens it
MAX_NUMBER_CHARS = 32  # a number literal longer than this is no duration or count anyone sends
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


@dataclass
class RouterBudget:
    """One router's report budget: ``BURST``/``REFILL`` for each worker it has been seen to run."""

    bucket: TokenBucket
    workers: dict[str, float] = field(default_factory=dict)  # instance -> last valid report

    @classmethod
    def new(cls, now: float) -> "RouterBudget":
        return cls(TokenBucket(BURST, REFILL, BURST, now))

    def size(self, now: float) -> int:
        for inst in [i for i, t in self.workers.items() if now - t > WORKER_TTL]:
            del self.workers[inst]
        return max(1, len(self.workers))

    def take(self, now: float) -> bool:
        n = self.size(now)
        self.bucket.capacity, self.bucket.rate = BURST * n, REFILL * n
        return self.bucket.take(now)

    def seen(self, instance: str, now: float) -> None:
        """A valid report from ``instance``: it widens the budget (up to ``MAX_WORKERS`` workers)."""
        if instance in self.workers or len(self.workers) < MAX_WORKERS:
            self.workers[instance] = now


class NumberRefused(ValueError):
    pass


def _constant(name: str) -> Any:
    raise NumberRefused(f"{name} is not a number this API accepts")


def _number(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        if len(text) > MAX_NUMBER_CHARS:
            raise NumberRefused(f"a number of {len(text)} characters ({text[:12]}...) is not a plausible value")
        value = kind(text)
        if not math.isfinite(value):
            raise NumberRefused(f"{text} is not a finite number")
        return value
    return parse


def parse_report(data: bytes) -> Any:
    """The body as JSON, refusing what JSON Schema's bounds cannot: NaN, infinities, absurdly long numbers."""
    return json.loads(data, parse_constant=_constant, parse_float=_number(float), parse_int=_number(int))


class EjectionsAPI:
    def __init__(self, cp: ControlPlane, router_name: Callable[[web.Request], str | None]):
        self.cp = cp
        self.router_name = router_name
        self.budgets: dict[str, RouterBudget] = {}

    async def handle(self, request: web.Request) -> web.Response:
        router = self.router_name(request)
        if router is None:
            log.warning("refused %s %s from %s: not a router certificate", request.method, request.path,
                        request.remote)
            return web.json_response({"error": "only a router certificate may report ejections"}, status=403)
        now = self.cp.clock()
        budget = self.budgets.get(router) or self.budgets.setdefault(router, RouterBudget.new(now))
        if not budget.take(now):
            n = budget.size(now)
            return web.json_response({"error": f"router {router!r} reports too often (at most {REFILL * n:g}/s "
                                               f"for the {n} worker(s) seen)"},
                                     status=429, headers={"Retry-After": "1"})
        try:
            doc = parse_report(await request.read())
        except NumberRefused as e:
            log.warning("refused an ejection report from router %r: %s", router, e)
            return web.json_response({"error": f"invalid ejection report: {e}"}, status=400)
        except (ValueError, RecursionError) as e:
            return web.json_response({"error": f"the body is not JSON: {e}"}, status=400)
        errors = schema_errors(doc, "router-ejections", limit=MAX_ERRORS)
        if errors:
            log.warning("refused an ejection report from router %r: %s", router, "; ".join(map(str, errors)))
            return web.json_response({"error": "invalid ejection report",
                                      "errors": [{"pointer": e.pointer, "message": e.message} for e in errors]},
                                     status=400)
        budget.seen(doc.get("instance", ""), now)
        self.cp.router_report(router, doc["ejections"], doc.get("instance", ""))
        return web.json_response({"accepted": len(doc["ejections"])}, status=202)
