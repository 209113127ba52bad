"""What a control plane that does not lead answers: nothing that acts.

With ``ha`` several ``llmgw server`` processes run and one leads
(``controlplane/leader.py``).  The others hold no authority:

* the agent stream is refused (503, the leader's URL in ``X-Llmgw-Leader``)
  with a ``Retry-After`` that spreads the agents it refused of late over the
  registration rate a leader admits (``controlplane/admission``): an agent
  waits that long, then dials the leader named or the next address it knows.
  After a leader dies every agent lands on a standby within a lease; told to
  come back at the rate the next leader can take them, they neither hammer
  the standbys with handshakes nor back off to ``reconnect_max`` (they take
  a standby's answer as a control plane that is up, see ``agent/stream``);
* the router watch is answered 503 with ``Retry-After`` ("keep what you
  have"): a standby knows no replica, and an empty answer would empty a
  router's table while the engines serve;
* admin writes are redirected (307) to the leader's ``advertise_url``, or
  refused 503 when no leader is known; reads are answered, marked
  ``X-Llmgw-Role: standby`` (a standby's view of the fleet is empty).

A leader that stops leading (its lease could not be renewed in time, its
key changed) does not try to become a standby in place: the process exits
(status 3) and its service manager starts it again as a fresh standby, so
no book of replicas from an old term is ever acted on.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from llmgw.controlplane.admission import Admission
from llmgw.protocol import LEADER_EPOCH_HEADER, STREAM_PATH, WATCH_PATH

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
DEPOSED_EXIT = 3
PASS_THROUGH = ("/healthz", "/openapi.json")


def standby_gate(elector: Any, registrations_per_second: Callable[[], float],
                 clock: Callable[[], float] = time.monotonic) -> Any:
    """An aiohttp middleware answering for a control plane while ``elector.is_leader`` is false.

    ``registrations_per_second``: the rate a leader admits agent streams at (read per refusal, so a
    reload applies), which sizes the Retry-After of a refused stream."""
    refusals = Admission()

    @web.middleware
    async def gate(request: web.Request, handler: Handler) -> web.StreamResponse:
        if elector.is_leader or request.path in PASS_THROUGH:
            return await handler(request)
        leader = elector.leader
        url = leader.url if leader is not None and leader.name != elector.name else None
        headers = {"X-Llmgw-Role": "standby"}
        if url:
            headers["X-Llmgw-Leader"] = url
        who = f"{leader.name} leads (term {leader.epoch})" if url else "no leader is known yet"
        if request.path == STREAM_PATH:
            retry = refusals.refuse(clock(), registrations_per_second())
            return web.json_response({"error": f"standby control plane: {who}", "leader": url,
                                      "retry_after_s": retry},
                                     status=503, headers={**headers, "Retry-After": str(retry)})
        if request.path == WATCH_PATH:
            return web.json_response({"error": f"standby control plane: {who}; keep what you have",
                                      "leader": url}, status=503, headers={**headers, "Retry-After": "1"})
        if request.method in ("GET", "HEAD"):
            resp = await handler(request)
            resp.headers.update(headers)
            return resp
        if url:
            return web.json_response({"error": f"standby control plane: {who}", "leader": url}, status=307,
                                     headers={**headers, "Location": url.rstrip("/") + request.path_qs})
        return web.json_response({"error": f"standby control plane: {who}; try again shortly"},
                                 status=503, headers={**headers, "Retry-After": "1"})

    return gate


def stamp_leader_epoch(handler: Handler | None, cp: Any) -> Handler | None:
    """The router watch, every answer carrying the leader's term (routers refuse a lower one)."""
    if handler is None:
        return None

    async def stamped(request: web.Request) -> web.StreamResponse:
        resp = await handler(request)
        if cp.leader_epoch:
            resp.headers[LEADER_EPOCH_HEADER] = str(cp.leader_epoch)
        return resp

    return stamped
