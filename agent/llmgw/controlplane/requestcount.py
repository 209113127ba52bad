"""``llmgw_admin_requests_total``: admin API requests by method and route, for ``/metrics``.

What reads the fleet, and how often, is the first question when the control
plane's loop runs late at 10,000 nodes: a client polling ``GET /v1/nodes``
(tens of megabytes) every few seconds shows up here beside one polling
``GET /v1/nodes/{node_id}``.  Labelled by the route's template, never by the
path asked for, so the series stay as few as the routes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from aiohttp import web
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

UNMATCHED = "(no route)"


class AdminRequests(Collector):
    """Counts the admin requests let through, by (method, route template)."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()

    def count(self, request: web.Request) -> None:
        resource = request.match_info.route.resource
        self.counts[(request.method, resource.canonical if resource is not None else UNMATCHED)] += 1

    def collect(self) -> Iterator[CounterMetricFamily]:
        fam = CounterMetricFamily("llmgw_admin_requests", "Admin API requests let through, by method and route",
                                  labels=["method", "route"])
        for (method, route), n in sorted(self.counts.items()):
            fam.add_metric([method, route], n)
        yield fam
