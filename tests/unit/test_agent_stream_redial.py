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

        async def discover() -> HardwareInventory:
            return HardwareInventory(node_id="n1", gpus=(), gpu_source="simulated")

        config = SupervisorConfig(node_id="n1", advertise_address="127.0.0.1", engine_bind_host="127.0.0.1",
                                  engine_ports=(30000, 30010), engine_commands={}, model_dir=str(tmp_path))
        client = StreamClient(url=f"ws://127.0.0.1:{port}/v1/agent/stream", node_id="n1", address="127.0.0.1",
                              ssl_context=None, supervisor=Supervisor(config, StateDir(tmp_path / "s"), lambda m: None),
                              discover=discover, reconnect_initial=0.01, reconnect_max=0.02)
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
