"""What every route a router POSTs to checks before it acts: the router's certificate, its rate, the body.

Routers tell the control plane what they saw (``ejections_api``), lease
slices of per-key limits (``allowance_api``) and ask for a sleeping model's
wake (``autoscale_wake_api``).  Each route takes the same three checks, in
this order, so a runaway or hostile router hurts only itself:

* only a router certificate may post, and the router is named by it, never
  by anything in the body, so one router cannot speak for another;
* each router is held to a token bucket that grows with the worker processes
  it has been seen to run (distinct ``instance`` values of valid posts
  lately, up to ``MAX_WORKERS``): every worker posts on its own, so a budget
  per router name alone refused most posts of a router with many workers;
  past it the answer is 429 with ``Retry-After``;
* the body is JSON whose numbers are finite and plausible (``NaN``,
  ``Infinity``, 400 digits refused: JSON Schema's bounds let them through)
  and valid against the route's schema; a refusal names every error (up to
  ``MAX_ERRORS``) with its JSON pointer and changes nothing.
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
from llmgw.controlplane.tokenbucket import TokenBucket

__all__ = ["MAX_ERRORS", "MAX_WORKERS", "NumberRefused", "RouterBudget", "RouterPost", "RouterPosts", "TokenBucket",
           "parse_report"]

MAX_WORKERS = 64  # workers of one router that widen its budget; more count as these
WORKER_TTL = 60.0  # a worker not heard from for this long no longer widens it
MAX_NUMBER_CHARS = 32  # a number literal longer than this is no duration or count anyone sends
MAX_ERRORS = 20  # a refusal names this many problems at most


@dataclass
class RouterBudget:
    """One router's budget on one route: ``burst``/``refill`` for each worker it has been seen to run."""

    burst: float
    refill: float
    bucket: TokenBucket
    workers: dict[str, float] = field(default_factory=dict)  # instance -> last valid post

    @classmethod
    def new(cls, now: float, burst: float, refill: float) -> "RouterBudget":
        return cls(burst, refill, TokenBucket(burst, refill, burst, now))

    def size(self, now: float) -> int:
        for inst in [i for i, t in self.workers.items() if now - t > WORKER_TTL]:
            del self.workers[inst]
        return max(1, len(self.workers))

    def take(self, now: float) -> bool:
        n = self.size(now)
        self.bucket.capacity, self.bucket.rate = self.burst * n, self.refill * n
        return self.bucket.take(now)

    def seen(self, instance: str, now: float) -> None:
        """A valid post from ``instance``: it widens the budget (up to ``MAX_WORKERS`` workers)."""
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


@dataclass(frozen=True)
class RouterPost:
    router: str  # from the certificate
    doc: Any  # the body, valid against the route's schema


class RouterPosts:
    """The checks of one route: ``read`` answers the refusal, or the router and its valid body.

    ``what`` completes "only a router certificate may ..." and names the body in refusals
    (``noun``); ``burst``/``refill`` are per worker seen; ``max_body`` (bytes), where the
    route's bodies are smaller than what the listener lets through."""

    def __init__(self, router_name: Callable[[web.Request], str | None], *, schema: str, what: str, noun: str,
                 burst: float, refill: float, log: logging.Logger, max_body: int | None = None) -> None:
        self.router_name = router_name
        self.schema = schema
        self.what = what
        self.noun = noun
        self.burst = burst
        self.refill = refill
        self.log = log
        self.max_body = max_body
        self.budgets: dict[str, RouterBudget] = {}

    async def read(self, request: web.Request, now: float) -> RouterPost | web.Response:
        router = self.router_name(request)
        if router is None:
            self.log.warning("refused %s %s from %s: not a router certificate", request.method, request.path,
                             request.remote)
            return web.json_response({"error": f"only a router certificate may {self.what}"}, status=403)
        budget = self.budgets.get(router) or self.budgets.setdefault(router, RouterBudget.new(now, self.burst,
                                                                                               self.refill))
        if not budget.take(now):
            n = budget.size(now)
            return web.json_response({"error": f"router {router!r} posts too often (at most {self.refill * n:g}/s "
                                               f"for the {n} worker(s) seen)"},
                                     status=429, headers={"Retry-After": "1"})
        too_big = f"the body is larger than {self.max_body} bytes"
        if self.max_body is not None and request.content_length is not None and request.content_length > self.max_body:
            return web.json_response({"error": too_big}, status=413)
        body = await request.read()  # the listener caps every body (client_max_size)
        if self.max_body is not None and len(body) > self.max_body:
            return web.json_response({"error": too_big}, status=413)
        try:
            doc = parse_report(body)
        except NumberRefused as e:
            self.log.warning("refused a %s from router %r: %s", self.noun, router, e)
            return web.json_response({"error": f"invalid {self.noun}: {e}"}, status=400)
        except (ValueError, RecursionError) as e:
            return web.json_response({"error": f"the body is not JSON: {e}"}, status=400)
        errors = schema_errors(doc, self.schema, limit=MAX_ERRORS)
        if errors:
            self.log.warning("refused a %s from router %r: %s", self.noun, router, "; ".join(map(str, errors)))
            return web.json_response({"error": f"invalid {self.noun}",
                                      "errors": [{"pointer": e.pointer, "message": e.message} for e in errors]},
                                     status=400)
        instance = doc.get("instance", "") if isinstance(doc, dict) else ""
        budget.seen(instance if isinstance(instance, str) else "", now)
        return RouterPost(router, doc)
