"""One dial per reconnect attempt: the backoff is the agent's only retry policy.

A control plane that accepts and hangs up (overloaded, or a load balancer
shedding) must see exactly one connection per attempt from an agent; a
transport-level "retry once at once" under each attempt would double the
herd the jittered backoff exists to spread.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from llmgw.agent.statedir import StateDir
from llmgw.agent.stream import StreamClient, stream_session
from llmgw.agent.supervisor import Supervisor, SupervisorConfig
from llmgw.hardware.types import HardwareInventory


def agent_client(tmp_path: Path, port: int, initial: float, maximum: float) -> StreamClient:
    """An agent's stream client with no engines, dialling ``port`` on loopback with this backoff."""
    async def discover() -> HardwareInventory:
        return HardwareInventory(node_id="n1", gpus=(), gpu_source="simulated")

    config = SupervisorConfig(node_id="n1", advertise_address="127.0.0.1", engine_bind_host="127.0.0.1",
                              engine_ports=(30000, 30010), engine_commands={}, model_dir=str(tmp_path))
    return StreamClient(url=f"ws://127.0.0.1:{port}/v1/agent/stream", node_id="n1", address="127.0.0.1",
                        ssl_context=None, supervisor=Supervisor(config, StateDir(tmp_path / "s"), lambda m: None),
                        discover=discover, reconnect_initial=initial, reconnect_max=maximum)


@pytest.mark.parametrize("shared", [False, True], ids=["own-session", "shared-session"])
def test_a_control_plane_that_hangs_up_gets_one_connection_per_attempt(tmp_path: Path, shared: bool):
    """Also through a session many clients share (``stream_session``, as the fleet simulator's
    agents use), which the client must leave open for the others."""
    async def main() -> tuple[int, int]:
        connections = 0

        async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal connections
            connections += 1
            await reader.readuntil(b"\r\n\r\n")  # the whole upgrade request, then nothing
            writer.close()

        server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]

        client = agent_client(tmp_path, port, 0.01, 0.02)
        session = stream_session() if shared else None
        task = asyncio.create_task(client.run_forever(session))
        try:
            while client.backoff.attempt < 5:
                await asyncio.sleep(0.01)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            server.close()
            await server.wait_closed()
            if session is not None:
                assert not session.closed
                await session.close()
        return connections, client.backoff.attempt

    connections, attempts = asyncio.run(main())
    # Cancelled at any point, at most the attempt in flight has dialled without being counted yet.
    assert attempts <= connections <= attempts + 1, (connections, attempts)


@pytest.mark.parametrize("standby", [True, False], ids=["standby", "failing"])
def test_a_standby_refusal_is_obeyed_and_does_not_grow_the_backoff(tmp_path: Path, standby: bool):
    """A standby's 503 means a control plane is up and a leader at most a lease away: the agent waits
    what it was told and keeps its backoff at the start, so it is not asleep for up to
    ``reconnect_max`` when the leader appears.  A control plane that fails the upgrade otherwise
    (here a 503 that is neither a standby's nor a Retry-After) still earns the growing backoff."""
    from aiohttp import web

    async def main() -> list[int]:
        dials: list[int] = []

        async def refuse(request: web.Request) -> web.Response:
            dials.append(client.backoff.attempt)  # the attempts counted before this dial
            headers = {"X-Llmgw-Role": "standby", "Retry-After": "0.01"} if standby else {}
            return web.json_response({"error": "no"}, status=503, headers=headers)

        app = web.Application()
        app.router.add_get("/v1/agent/stream", refuse)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]

        client = agent_client(tmp_path, port, 0.001, 0.002)
        task = asyncio.create_task(client.run_forever())
        try:
            while len(dials) < 8:
                await asyncio.sleep(0.002)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await runner.cleanup()
        return dials

    seen = asyncio.run(main())
    if standby:
        assert max(seen) <= 1, seen
    else:
        assert max(seen) >= 5, seen
