"""Tokenizing requests off the event loop, under a deadline: a bounded thread pool.

Encoding a long prompt with a real tokenizer costs tens of milliseconds (34 ms for 11.4k tokens
measured for #30); on the event loop that would stall every stream the router relays. So the
work runs in a few threads, and the request waits at most ``deadline`` seconds for it: a prompt
that is not tokenized by then (the pool is saturated, or the prompt is pathological) is routed
by prefix affinity instead, counted by reason, and its job is cancelled if it never started.
At most ``threads * QUEUE_PER_THREAD`` jobs wait: past that a request falls back at once
rather than queueing work whose answer would come too late to use.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Callable

from llmgw import compat

QUEUE_PER_THREAD = 4


class TokenizePool:
    def __init__(self, threads: int, deadline: float) -> None:
        self.deadline = deadline
        self.limit = threads * QUEUE_PER_THREAD
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=threads,
                                                               thread_name_prefix="llmgw-tokenize")
        self._lock = threading.Lock()
        self._pending = 0

    async def run(self, fn: Callable[..., Any], *args: Any) -> tuple[Any, str | None]:
        """``(fn(*args), None)``, or ``(None, reason)``: ``busy``, ``timeout`` or ``error``."""
        with self._lock:
            if self._pending >= self.limit:
                return None, "busy"
            self._pending += 1
        try:
            fut = self._executor.submit(fn, *args)
        except RuntimeError:  # shut down
            self._done(None)
            return None, "busy"
        fut.add_done_callback(self._done)
        try:
            return await compat.wait_for(asyncio.wrap_future(fut), self.deadline), None
        except TimeoutError:
            fut.cancel()
            return None, "timeout"
        except Exception:
            return None, "error"

    def _done(self, _fut: Any) -> None:
        with self._lock:
            self._pending -= 1

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
