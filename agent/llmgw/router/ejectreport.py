"""Telling the control plane which engines this router has ejected.

The router sees an engine fail on real requests long before anything else
does (an engine whose ``/health`` stays 200 while every completion errors
passes the agent's idle check), but its view is one network path.  So the
router only reports; the control plane counts reports from several routers
before it acts (``controlplane/ejections.py``).

``POST /v1/router/ejections`` with the router certificate, every
``REPORT_INTERVAL`` while at least one endpoint is in an ejection episode
(ejected, or back on probation and not yet proven healthy by a success).
Each report says how long the episode has lasted, not when it began: the
two hosts' clocks need not agree, and a control plane that restarted learns
the whole length from the next report.  A router that stops reporting
(recovered endpoint, router gone) simply falls silent; the control plane
forgets its report after a while.  Nothing is sent while nothing is ejected.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import ssl
import time
from typing import Any, Mapping, Sequence

import aiohttp

from llmgw.protocol import EJECTIONS_PATH

from .cpposts import ReportPoster
from .runtime import Routing

log = logging.getLogger("llmgw.router.ejectreport")

REPORT_INTERVAL = 2.0  # seconds between reports while something is ejected
MAX_ENTRIES = 256  # the schema's bound; a router with more ejected endpoints sends the longest-ejected
MAX_COUNT = 10**9  # the schema's bound on counts


def ejection_entries(routing: Routing, now: float) -> list[dict[str, Any]]:
    """The endpoints in an ejection episode, longest first, as the report carries them."""
    routing.sync()
    out = []
    for rt in routing.runtimes():
        h = rt.health
        if h.episode_since is None or not rt.endpoint.replica_id:
            continue
        out.append({
            "endpoint_id": rt.id,
            "replica_id": rt.endpoint.replica_id,
            "model": rt.endpoint.model,
            "reason": h.last_failure or "failures",
            "ejected_for_s": round(max(0.0, now - h.episode_since), 3),
            "ejected_now": h.is_ejected(now),
            "consecutive_failures": min(h.episode_failures, MAX_COUNT),
            "ejections": min(h.ejections, MAX_COUNT),
        })
    out.sort(key=lambda e: -e["ejected_for_s"])
    return out[:MAX_ENTRIES]


async def report_ejections(urls: Sequence[str], ssl_context: ssl.SSLContext | None, routing: Routing,
                           headers: Mapping[str, str] | None = None, interval: float = REPORT_INTERVAL) -> None:
    """Report ejections to the control plane at ``url`` for as long as the router runs.

    Failures (control plane down, refused) are logged once per kind and
    retried at the next interval: the report is re-sent whole every time,
    so nothing is lost by skipping one.
    """
    poster = ReportPoster(urls, EJECTIONS_PATH, log)
    instance = secrets.token_hex(6)  # this worker: each worker of a router ejects on its own
    timeout = aiohttp.ClientTimeout(total=10)
    connector = aiohttp.TCPConnector(limit=1, ssl=ssl_context if ssl_context is not None else True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, headers=dict(headers or {})) as s:
        while True:
            await asyncio.sleep(interval)
            entries = ejection_entries(routing, time.monotonic())
            if not entries:
                continue
            await poster.post(s, {"instance": instance, "ejections": entries},
                              f"{len(entries)} ejected endpoint(s) not reported; retrying every {interval:g}s")
