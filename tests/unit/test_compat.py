"""llmgw.compat behaves as Python 3.11's asyncio on every interpreter the runtime supports
(`make pythons` runs this on 3.10 and 3.13, the suite on 3.11)."""

from __future__ import annotations

import asyncio

import pytest

from llmgw import compat


def test_timeout_raises_the_builtin_timeout_error_and_cancels_the_body():
    cancelled = []

    async def main():
        with pytest.raises(TimeoutError) as info:  # the built-in: `except TimeoutError` catches it on 3.10 too
            async with compat.timeout(0.01):
                try:
                    await asyncio.sleep(30)
                except asyncio.CancelledError:
                    cancelled.append(True)
                    raise
        return info.type

    assert asyncio.run(main()) is TimeoutError
    assert cancelled == [True]


def test_timeout_at_passes_results_and_other_errors_through():
    async def main():
        loop = asyncio.get_running_loop()
        async with compat.timeout_at(loop.time() + 30):
            value = await asyncio.sleep(0, result=7)
        with pytest.raises(KeyError):
            async with compat.timeout_at(loop.time() + 30):
                raise KeyError("x")
        async with compat.timeout(None):
            await asyncio.sleep(0)
        return value

    assert asyncio.run(main()) == 7


def test_run_uses_the_loop_factory_and_closes_the_loop():
    made = []

    def factory():
        loop = asyncio.new_event_loop()
        made.append(loop)
        return loop

    async def main():
        return asyncio.get_running_loop()

    assert compat.run(main(), loop_factory=factory) is made[0]
    assert made[0].is_closed()
    assert compat.run(asyncio.sleep(0, result="default")) == "default"


def test_a_transport_paused_at_accept_leaves_the_first_bytes_in_the_socket():
    """What the control plane's TLS site needs: the ClientHello waits for start_tls."""

    async def main():
        got: list[bytes] = []
        accepted: asyncio.Future[asyncio.Transport] = asyncio.get_running_loop().create_future()

        class Paused(asyncio.Protocol):
            def connection_made(self, transport):
                compat.pause_reading_at_accept(transport)
                accepted.set_result(transport)

            def data_received(self, data):
                got.append(data)

        server = await asyncio.get_running_loop().create_server(Paused, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"hello")
        await writer.drain()
        transport = await accepted
        for _ in range(20):  # loop iterations in which a reader, had it stayed registered, would run
            await asyncio.sleep(0.005)
        before = list(got)
        transport.resume_reading()
        while not got:
            await asyncio.sleep(0.005)
        writer.close()
        server.close()
        return before, b"".join(got)

    assert asyncio.run(main()) == ([], b"hello")
