"""Running an llmgw daemon's event loop: uvloop, and a garbage collector kept out of the way.

The router runs on uvloop (thousands of requests a second); the control plane
stays on asyncio's loop (its TLS site pauses transports at accept, which
uvloop does not honour, see ``controlplane.server``) but holds thousands of
long-lived stream objects, so both tune the cyclic collector the same way.
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any


def tune_gc() -> None:
    """Keep the cyclic garbage collector off the request path's critical share of CPU.

    Every request allocates hundreds of container objects (aiohttp's request,
    headers, tasks, futures), so the default gen-0 threshold of 700 ran a
    collection several times per request, and the older generations kept
    re-scanning everything imported at startup: together about a twentieth of
    a worker's CPU.  Objects alive once the app is built are frozen (never
    scanned again) and collections run every 20,000 allocations instead.
    Request state is freed by reference counting; cycles are rare and still
    collected.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)


def run_loop(coro: Any) -> Any:
    """Run ``coro`` to its result on uvloop when it is installed: it roughly halves the loop's share of
    CPU per event."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep running without it
        return asyncio.run(coro)
    return uvloop.run(coro)
