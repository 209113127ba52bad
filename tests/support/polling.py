"""Wait on a condition with a deadline, and fail naming what was awaited.

A loaded 2-core CI machine turns any fixed sleep into either waste or a flaky
failure; a poll with a generous deadline costs only what the condition takes.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any, Awaitable, Callable, TypeVar

WAIT = 120.0  # generous: a loaded 2-core machine must not turn slowness into failure

T = TypeVar("T")


def _message(what: str, timeout: float, on_timeout: Callable[[], str]) -> str:
    extra = on_timeout()
    return f"timed out after {timeout:g}s waiting for {what}" + (f"\n{extra}" if extra else "")


def until(pred: Callable[[], T], what: str = "condition", timeout: float = WAIT,
          on_timeout: Callable[[], str] = lambda: "", interval: float = 0.1,
          error: type[Exception] = AssertionError) -> T:
    """Poll ``pred`` until it returns something truthy and return that; past ``timeout`` raise
    ``error`` naming ``what`` (and whatever ``on_timeout`` adds, e.g. a process's output)."""
    end = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > end:
            raise error(_message(what, timeout, on_timeout))
        time.sleep(interval)


async def until_async(pred: Callable[[], T], what: str = "condition", timeout: float = WAIT,
                      on_timeout: Callable[[], str] = lambda: "", interval: float = 0.05) -> T:
    """``until`` inside an event loop: the loop keeps running between polls."""
    end = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > end:
            raise AssertionError(_message(what, timeout, on_timeout))
        await asyncio.sleep(interval)


def run_async(fn: Callable[..., Awaitable[Any]], timeout: float = 60.0) -> Callable[..., None]:
    """Decorate a coroutine test so it runs on a fresh event loop, at most ``timeout`` seconds."""
    @functools.wraps(fn)
    def wrapper(*a: Any, **kw: Any) -> None:
        asyncio.run(asyncio.wait_for(fn(*a, **kw), timeout))
    return wrapper
