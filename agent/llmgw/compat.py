"""What the runtime uses from Python 3.11+, for the 3.10 that GPU nodes still ship.

Ubuntu 22.04 and DGX OS 6 have Python 3.10; the runtime (agent, control plane,
router, ``llmgw ctl``) runs there too. This is the one place that knows: on 3.11
and newer every name here *is* the standard library's, so nothing changes where
the runtime is measured; on 3.10 it is a small equivalent with the same behaviour.

``pause_reading_at_accept`` stops a just-accepted transport reading from inside
its protocol's ``connection_made``: 3.10's selector transport registers its reader
*after* ``connection_made`` whether or not it was paused there, so the first bytes
(a TLS ClientHello waiting for ``start_tls``) would be read and lost.

``timeout``/``timeout_at`` raise the built-in ``TimeoutError`` on expiry, as
``asyncio.timeout`` does since 3.11 (on 3.10 ``asyncio.TimeoutError`` is a
different class, so ``except TimeoutError`` would miss it).

``wait_for`` is ``asyncio.wait_for`` from 3.12 on.  Before 3.12 (CPython
gh-86296) ``asyncio.wait_for`` returns the result when the awaited thing
completes in the same loop iteration as the task is cancelled, and the
cancellation is lost: a loop that waits on an event with a timeout, kicked
by every agent that registers, then never stops on SIGTERM.  Here it is a
timeout scope around the await, which lets a cancellation through; on expiry
it raises the built-in ``TimeoutError`` on every version.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["pause_reading_at_accept", "run", "timeout", "timeout_at", "wait_for"]

if sys.version_info >= (3, 11):
    from asyncio import timeout, timeout_at

    def run(main: Coroutine[Any, Any, T], *,
            loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None) -> T:
        """``asyncio.run`` on the loop ``loop_factory`` makes (the default loop when None)."""
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            return runner.run(main)

    def pause_reading_at_accept(transport: asyncio.Transport) -> None:
        """Pause a transport from its protocol's ``connection_made``: the bytes wait in the socket."""
        transport.pause_reading()

else:  # Python 3.10
    import async_timeout  # aiohttp's own dependency below 3.11

    class _Timeout:
        """``async_timeout``'s context manager, raising ``TimeoutError`` like 3.11's."""

        __slots__ = ("_cm",)

        def __init__(self, cm: async_timeout.Timeout) -> None:
            self._cm = cm

        async def __aenter__(self) -> _Timeout:
            await self._cm.__aenter__()
            return self

        async def __aexit__(self, et: Any, e: Any, tb: Any) -> bool | None:
            try:
                return await self._cm.__aexit__(et, e, tb)
            except asyncio.TimeoutError as expired:
                raise TimeoutError() from expired

    def pause_reading_at_accept(transport: asyncio.Transport) -> None:
        """Pause a transport from its protocol's ``connection_made``: the bytes wait in the socket.

        Queued behind the transport's own ``_add_reader``, and run in the same loop
        iteration, before the selector is polled: nothing is read in between."""
        asyncio.get_running_loop().call_soon(transport.pause_reading)

    def timeout(delay: float | None) -> _Timeout:
        return _Timeout(async_timeout.timeout(delay))

    def timeout_at(when: float | None) -> _Timeout:
        return _Timeout(async_timeout.timeout_at(when))

    def run(main: Coroutine[Any, Any, T], *,
            loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None) -> T:
        """``asyncio.run`` on the loop ``loop_factory`` makes (the default loop when None)."""
        if loop_factory is None:
            return asyncio.run(main)
        loop = loop_factory()
        try:
            asyncio.set_event_loop(loop)
            return loop.run_until_complete(main)
        finally:
            try:
                _cancel_all(loop)
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.run_until_complete(loop.shutdown_default_executor())
            finally:
                asyncio.set_event_loop(None)
                loop.close()

    def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
        """What ``asyncio.run`` does on the way out: cancel what is left and let it finish."""
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))


if sys.version_info >= (3, 12):
    from asyncio import wait_for
else:
    async def wait_for(aw: Awaitable[T], timeout: float | None) -> T:  # noqa: F811 (the module's ``timeout``)
        """``asyncio.wait_for`` without gh-86296: a cancellation always propagates.

        Built on ``asyncio.wait``, which never cancels the waiter itself: a
        timeout scope (``async_timeout`` on 3.10) that fires in the same
        iteration as an outside cancellation turns that cancellation into
        its own timeout, and a loop that waits with a short period then
        never stops.
        """
        task = asyncio.ensure_future(aw)
        try:
            done, _ = await asyncio.wait({task}, timeout=timeout)
        except BaseException:  # cancelled from outside: take the inner wait down too, and go on cancelling
            task.cancel()
            raise
        if done:
            return task.result()
        task.cancel()
        await asyncio.wait({task})  # let it unwind; a cancellation from outside still raises here
        raise TimeoutError()
