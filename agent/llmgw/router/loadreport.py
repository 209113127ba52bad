"""Telling the control plane how many requests this worker has in flight to each replica.

The autoscaler's signal (docs/autoscaling.md) is requests in flight per
deployment. The control plane's own router counts them in its process; a
standalone router's clients are invisible to it unless the router says. So
each worker posts its count per replica (``POST /v1/router/load``, router
certificate) every ``REPORT_INTERVAL``, an empty map included: the report is
also the sign that this worker is alive, and a worker that falls silent
holds the control plane's counts rather than read as idle
(``controlplane/routerload``). Replicas with nothing in flight are left out,
so an idle router's report is a few bytes whatever the fleet's size.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import ssl
from collections.abc import Sequence
from typing import Any

import aiohttp

from llmgw.protocol import LOAD_PATH

from .cpposts import ReportPoster
from .runtime import Routing

log = logging.getLogger("llmgw.router.loadreport")

REPORT_INTERVAL = 1.0  # seconds between reports (the control plane samples once a pass, at least once a second)
MAX_ENTRIES = 4096  # the schema's bound; past it, the replicas with the most in flight


def in_flight(routing: Routing) -> dict[str, int]:
    """Requests in flight per replica id (those with none left out), and the requests held for a
    sleeping model counted on one of its replicas: demand that waits for a wake is demand, and the
    autoscaler sums a deployment's replicas, so which one carries them does not matter."""
    routing.sync()
    counts: dict[str, int] = {}
    for rt in routing.runtimes():
        rid = rt.endpoint.replica_id
        if rid and rt.outstanding > 0:
            counts[rid] = counts.get(rid, 0) + rt.outstanding
    for model, n in routing.held.items():
        group = routing.group(model)
        rid = next((m.endpoint.replica_id for m in group.members if m.endpoint.replica_id), None) if group else None
        if rid and n > 0:
            counts[rid] = counts.get(rid, 0) + n
    return counts


def load_entries(routing: Routing) -> dict[str, int]:
    """Requests in flight per replica id (``in_flight``), the busiest first when more than the report holds."""
    counts = in_flight(routing)
    if len(counts) > MAX_ENTRIES:
        counts = dict(sorted(counts.items(), key=lambda kv: -kv[1])[:MAX_ENTRIES])
    return counts


async def report_load(urls: Sequence[str], ssl_context: ssl.SSLContext | None, routing: Routing,
                      interval: float = REPORT_INTERVAL) -> None:
    """Report this worker's load to the control plane (the leader among ``urls``) for as long as the
    router runs.

    A failed report (control plane down, refused) is logged once per kind and not retried: the
    next one, a second later, says everything again, to the next address if this one was down."""
    poster = ReportPoster(urls, LOAD_PATH, log)
    instance = secrets.token_hex(6)  # this worker: each balances its own requests
    timeout = aiohttp.ClientTimeout(total=5)
    connector = aiohttp.TCPConnector(limit=1, ssl=ssl_context if ssl_context is not None else True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as s:
        while True:
            await asyncio.sleep(interval)
            body: dict[str, Any] = {"instance": instance, "outstanding": load_entries(routing)}
            await poster.post(s, body, "load not reported: the autoscaler holds counts while this worker is "
                                       f"silent; retrying every {interval:g}s")
