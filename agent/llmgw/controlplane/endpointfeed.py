"""The rank-0 endpoint set, handed to its listeners (the in-process router, the watch) when it changes."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("llmgw.controlplane")

Endpoints = list[dict[str, Any]]


class EndpointFeed:
    def __init__(self) -> None:
        self._listeners: list[Callable[[Endpoints], None]] = []
        self._last: Endpoints | None = None

    def subscribe(self, listener: Callable[[Endpoints], None], now: Endpoints) -> None:
        """Call ``listener`` with every later change, and with ``now`` at once."""
        self._listeners.append(listener)
        listener(now)

    def publish(self, eps: Endpoints) -> None:
        """Hand ``eps`` to every listener if it differs from the last set; one failing listener stops no other."""
        if eps == self._last:
            return
        self._last = eps
        log.info("router endpoints: %s", ", ".join(f"{e['model']}@{e['url']}{' (draining)' if e['draining'] else ''}"
                                                 f"{' (asleep)' if e.get('sleeping') else ''}"
                                                 for e in eps) or "none")
        for listener in self._listeners:
            try:
                listener(eps)
            except Exception:
                log.exception("endpoint listener failed")
