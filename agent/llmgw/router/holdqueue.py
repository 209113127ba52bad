"""Holding requests for a model whose replicas are all asleep, or that is at zero, while one wakes.

An engine put to sleep by the control plane (docs/autoscaling.md) is in the
endpoint table marked ``sleeping``; the pick never chooses it.  A request
for a model that has endpoints but none awake would otherwise be answered
503 at once, and the model would never wake: nothing else tells the control
plane that someone wants it.  Here such a request:

- asks for a wake (``wake(model)``: the in-process router calls the control
  plane directly, a standalone one posts ``/v1/router/wake`` with its router
  certificate (``ControlPlaneWaker``); at most once per ``WAKE_EVERY`` per
  model, the control plane's own pass repeats what it decided);
- waits, its body read but not a byte of it sent anywhere, until the table
  shows an endpoint of the model awake, then goes on to the ordinary pick;
  the waiters of one model are released together, in the order they came;
- is answered 503 with ``Retry-After`` (OpenAI's error shape, code
  ``model_waking``) when ``hold.max_requests`` are held for the model
  already or after ``hold.deadline`` seconds: the client is told to come
  back, the request is never dropped silently.

A model that scales to zero (``autoscale.min: 0``, named in the table's
``from_zero``) and has no endpoint left is held the same way: its wake
carries the number held (``wake(model, held)``), the only demand the
control plane can see for a deployment with no replica to count it on, and
the request goes on once the replica it starts is Ready.

``held`` counts the requests held per model now (the routing's own count: the load
reports add them to the model's in-flight requests, so a burst against a sleeping model
raises its count while it wakes, not only once its requests run).
"""

from __future__ import annotations

import asyncio
import logging
import math
import ssl
import time
from collections.abc import Callable, Sequence

import aiohttp

from llmgw.protocol import WAKE_PATH

from .cpposts import ReportPoster
from .errors import SERVER, RouterError
from .runtime import ModelGroup, Routing
from .settings import Hold

log = logging.getLogger("llmgw.router")

WAKE_EVERY = 1.0  # s: the most often one model's wake is asked for by one router


def all_asleep(group: ModelGroup) -> bool:
    """Endpoints, and none of them awake and taking requests: only a wake helps (worked out per
    table revision, ``ModelGroup.asleep``)."""
    return group.asleep


def waking(model: str, why: str, retry_after: float) -> RouterError:
    return RouterError(503, f"model {model!r} is waking up ({why}); retry in {math.ceil(retry_after)} s",
                       SERVER, "model_waking", klass="unavailable", retry_after=max(1, math.ceil(retry_after)))


class HoldQueue:
    def __init__(self, routing: Routing, hold: Hold, wake: Callable[..., object] | None = None) -> None:
        self.routing = routing
        self.hold = hold
        self.wake = wake
        self.held = routing.held
        self._asked: dict[str, float] = {}

    def _ask(self, model: str, group: ModelGroup) -> None:
        now = time.monotonic()
        if self.wake is None or now - self._asked.get(model, -math.inf) < WAKE_EVERY:
            return
        self._asked[model] = now
        try:
            if any(not m.endpoint.draining for m in group.members):
                self.wake(model)
            else:  # none left but draining: the held count is the only demand the control plane can see
                self.wake(model, self.held.get(model, 0))
        except Exception:  # noqa: BLE001 - the request still waits; the next one asks again
            log.exception("asking for a wake of %s failed", model)

    async def admit(self, model: str, group: ModelGroup) -> ModelGroup:
        """``group`` when an endpoint is awake; else the group once one is, having held the request."""
        if not all_asleep(group):
            return group
        held = self.held.get(model, 0)
        if held >= self.hold.max_requests:
            raise waking(model, f"{held} request(s) held already", self.hold.deadline)
        self.held[model] = held + 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.hold.deadline
        try:
            while True:
                self._ask(model, group)
                left = deadline - loop.time()
                if left <= 0:
                    raise waking(model, f"not awake within {self.hold.deadline:g} s", self.hold.deadline)
                rev = self.routing.revision  # the revision the group just checked was built from
                await self.routing.table.wait_changed(rev, min(left, WAKE_EVERY))
                self.routing.sync()
                now = self.routing.group(model)
                if now is None:
                    raise waking(model, "its endpoints left the table", self.hold.deadline)
                if not all_asleep(now):
                    return now
                group = now
        finally:
            self.held[model] -= 1
            if not self.held[model]:
                del self.held[model]


class ControlPlaneWaker:
    """``wake(model)`` for a standalone router: ``POST /v1/router/wake`` in the background.

    The request being held does not wait on this call: it waits on the
    endpoint table, which the watch updates however the wake came about.  A
    failed call is logged once per kind of failure; the held request asks
    again a second later, of the next control plane when this one was down.
    """

    def __init__(self, urls: Sequence[str], ssl_context: ssl.SSLContext | None, timeout: float = 10.0) -> None:
        self.poster = ReportPoster(urls, WAKE_PATH, log)
        self.ssl_context = ssl_context
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def __call__(self, model: str, held: int | None = None) -> None:
        task = asyncio.get_running_loop().create_task(self._post(model, held))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _post(self, model: str, held: int | None) -> None:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                connector=aiohttp.TCPConnector(limit=4, ssl=self.ssl_context if self.ssl_context is not None else True))
        # ``held`` only for a model at zero replicas: a control plane that predates scale from zero
        # refuses the key, and has no such model to start
        body = {"model": model} if held is None else {"model": model, "held": held}
        await self.poster.post(self._session, body, f"{model} not woken from here; the held request asks again")

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._session is not None:
            await self._session.close()
