"""The body deadline belongs to the client: a stall of the server's own loop past it is excused.

A loaded host (the upgrade scenario: three test hosts on two cores) stalled a
router's loop past a request's body deadline while the client's body sat in the
socket; the bytes and the expired timer were seen in one loop iteration, the
cancelling timer won, and an on-time client got 408. These run a real aiohttp
server on loopback and a raw-socket client in a thread.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

from aiohttp import web

from llmgw.clientbounds import BodyTooSlow, ClientBounds, read_body
from tests.support.polling import run_async as run

BOUNDS = ClientBounds(body_grace=0.3, body_min_rate=1 << 30)
BODY = b'{"x": 1234}'


async def serve(stall: float) -> tuple[web.AppRunner, int, threading.Event]:
    entered = threading.Event()

    async def handler(request: web.Request) -> web.Response:
        entered.set()
        if stall:
            # the loop blocks from 50 ms on, past the 0.3 s deadline, while the body arrives
            asyncio.get_running_loop().call_later(0.05, time.sleep, stall)
        try:
            body = await read_body(request, request.content_length or 0, BOUNDS)
        except BodyTooSlow as e:
            return web.Response(status=408, text=str(e))
        return web.Response(text=f"{len(body)}")

    app = web.Application()
    app.router.add_post("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, port, entered


def client(port: int, entered: threading.Event, send_body_after: float | None, out: list[bytes]) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(BODY))
        assert entered.wait(10)
        if send_body_after is not None:
            time.sleep(send_body_after)
            s.sendall(BODY)
        out.append(s.recv(65536))


async def exchange(stall: float, send_body_after: float | None) -> bytes:
    runner, port, entered = await serve(stall)
    out: list[bytes] = []
    try:
        t = threading.Thread(target=client, args=(port, entered, send_body_after, out), daemon=True)
        t.start()
        while t.is_alive():
            await asyncio.sleep(0.02)
    finally:
        await runner.cleanup()
    return out[0]


@run
async def test_a_body_sent_while_the_servers_loop_was_stalled_past_its_deadline_is_read():
    # the body is sent 0.2 s in, during a 2 s stall of the server's loop that spans the deadline
    answer = await exchange(stall=2.0, send_body_after=0.2)
    assert answer.startswith(b"HTTP/1.1 200"), answer
    assert answer.endswith(str(len(BODY)).encode())


@run
async def test_a_body_never_sent_is_still_cut_at_its_deadline():
    answer = await exchange(stall=0.0, send_body_after=None)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"not received within 0.3s" in answer


@run
async def test_a_stall_excuses_the_client_once_not_forever():
    # the loop was late, so the client is given that lateness again; it still sends nothing: 408
    answer = await exchange(stall=2.0, send_body_after=None)
    assert answer.startswith(b"HTTP/1.1 408"), answer
