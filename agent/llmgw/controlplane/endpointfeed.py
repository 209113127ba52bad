"""The rank-0 endpoint set, handed to its listeners (the in-process router, the watch) when it changes."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("llmgw.controlplane")

Endpoints = list[dict[str, Any]]


@dataclass(frozen=True)
class Published:
    """What the routers are told: the endpoints, and the served names of the deployments that scale
    from zero (a request for one with no endpoint is held while a replica starts)."""

    endpoints: Endpoints
    from_zero: tuple[str, ...] = ()


class EndpointFeed:
    def __init__(self) -> None:
        self._listeners: list[Callable[[Published], None]] = []
        self._last: Published | None = None

    def subscribe(self, listener: Callable[[Published], None], now: Published) -> None:
        """Call ``listener`` with every later change, and with ``now`` at once."""
        self._listeners.append(listener)
        listener(now)

    def publish(self, published: Published) -> None:
        """Hand ``published`` to every listener if it differs from the last; one failing listener stops no other."""
        if published == self._last:
            return
        if self._last is None or published.from_zero != self._last.from_zero:
            log.info("models that scale from zero: %s", ", ".join(published.from_zero) or "none")
        self._last = published
        eps = published.endpoints
        log.info("router endpoints: %s", ", ".join(f"{e['model']}@{e['url']}{' (draining)' if e['draining'] else ''}"
                                                 f"{' (asleep)' if e.get('sleeping') else ''}"
                                                 for e in eps) or "none")
        for listener in self._listeners:
            try:
                listener(published)
            except Exception:
                log.exception("endpoint listener failed")
