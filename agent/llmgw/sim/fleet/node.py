"""One simulated agent: the agent's own stream client and supervisor, plus fault switches.

``SimStreamClient`` is ``llmgw.agent.stream.StreamClient`` with counting and
faults layered on its hooks; connecting, TLS, registering, heartbeats,
obeying start/stop/drain and redialling with jittered backoff are the real
agent's code.  Faults:

* silence: the connection stays open (WebSocket pings are still answered,
  as a kernel answers TCP while the agent is wedged) but no heartbeat goes
  out; other messages wait and are delivered on heal, as a stalled TCP
  stream would deliver them;
* kill: the agent's connection drops as a killed process's would (no
  WebSocket close frame), and the node stays down until restarted; its shards (engines) live on and the new
  agent reports them as adopted;
* flap: killed and restarted again and again;
* slow register: the register goes out some seconds after the WebSocket is up;
* malformed / oversized: one message the control plane must refuse.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from typing import Any, Callable

import aiohttp

from llmgw.agent.stream import StreamClient
from llmgw.hardware.types import HardwareInventory
from llmgw.protocol import MAX_MESSAGE
from llmgw.sim.fleet.shards import SimSupervisor

log = logging.getLogger(__name__)

SHARED_RNG = random.Random()
MALFORMED = {"type": "shard_status", "shard_id": "", "state": "exploded"}  # fails the stream schema


class SimStreamClient(StreamClient):
    """The agent's ``StreamClient``, counting and faulted through its public hooks only."""

    def __init__(self, *, sent: Counter, **kw: Any):
        super().__init__(**kw)
        self.backoff.rng = SHARED_RNG  # one Mersenne Twister state (2.5 KB) per process, not per agent
        self.sent = sent  # message type -> count, shared by the process's nodes
        self.registrations = 0
        self.registered = False  # on the current connection
        self.connect_errors = 0
        self.silenced = False
        self.slow_register = 0.0
        self.held: list[dict[str, Any]] = []

    def send(self, msg: dict[str, Any]) -> None:
        if self.silenced:
            if msg.get("type") != "heartbeat":
                self.held.append(msg)
            return
        if self.connected:
            self.sent[msg.get("type", "?")] += 1
        super().send(msg)

    def register_message(self, hw: HardwareInventory) -> dict[str, Any]:
        self.sent["register"] += 1
        return super().register_message(hw)

    def heal(self) -> None:
        self.silenced = False
        held, self.held = self.held, []
        for m in held:
            self.send(m)

    def send_raw(self, msg: dict[str, Any]) -> bool:
        """Queue ``msg`` as is, bypassing silence; False when not connected."""
        if not self.connected:
            return False
        self.sent[str(msg.get("type", "?"))] += 1
        StreamClient.send(self, msg)
        return True

    def on_dial_end(self, error: BaseException | None, upgraded: bool) -> None:
        self.registered = False
        if upgraded or not isinstance(error, Exception):  # cancelled, or the stream was up
            return
        if isinstance(error, aiohttp.WSServerHandshakeError) and error.status == 503:
            return  # admission control, counted apart (``refusals``)
        self.connect_errors += 1

    async def before_register(self) -> None:
        if self.slow_register > 0:
            await asyncio.sleep(self.slow_register)

    def on_registered(self) -> None:
        self.registrations += 1
        self.registered = True

    def abort(self) -> None:
        """Drop the connection as a dying process's kernel would: no close frame, no TLS close_notify."""
        ws = self.ws
        conn = getattr(getattr(ws, "_response", None), "connection", None)  # aiohttp has no public handle
        transport = getattr(conn, "transport", None)
        if transport is not None:
            transport.abort()


class SimNode:
    """A simulated agent's life: its client task, killed and restarted at will."""

    def __init__(self, number: int, node_id: str, make_client: Callable[["SimNode"], SimStreamClient],
                 supervisor_factory: Callable[[Callable[[dict[str, Any]], None]], SimSupervisor],
                 session: aiohttp.ClientSession):
        self.number = number
        self.node_id = node_id
        self.session = session
        self.make_client = make_client
        self.supervisor = supervisor_factory(self._emit)
        self.client = make_client(self)
        self.task: asyncio.Task[None] | None = None
        self.killed = False
        self.lives = 0
        self.flapper: asyncio.Task[None] | None = None

    def _emit(self, msg: dict[str, Any]) -> None:
        self.client.send(msg)

    def start(self) -> None:
        if self.task is None or self.task.done():
            self.lives += 1
            self.killed = False
            self.task = asyncio.get_running_loop().create_task(self.client.run_forever(self.session),
                                                               name=f"agent {self.node_id}")

    async def kill(self) -> None:
        """End the agent as SIGKILL would: its connection drops, its engines stay."""
        self.killed = True
        if self.task is not None and not self.task.done():
            self.client.abort()
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        self.task = None

    async def restart(self) -> None:
        """A new agent process: fresh client, same engines, reported as adopted."""
        await self.kill()
        old = self.client
        self.client = self.make_client(self)
        for counter in ("registrations", "connect_errors", "connections"):  # the node's totals, across lives
            setattr(self.client, counter, getattr(old, counter))
        self.client.slow_register = old.slow_register
        self.client.silenced = old.silenced  # a partition outlives the agent process
        self.supervisor.adopt_all()
        self.start()

    async def flap(self, period: float, down: float) -> None:
        while True:
            await asyncio.sleep(random.uniform(0.5, 1.5) * period)
            await self.kill()
            await asyncio.sleep(random.uniform(0.0, down))
            await self.restart()

    def stop_flapping(self) -> None:
        if self.flapper is not None:
            self.flapper.cancel()
            self.flapper = None

    @property
    def connected(self) -> bool:
        return self.client.connected

    def malformed(self) -> bool:
        return self.client.send_raw(dict(MALFORMED))

    def oversized(self) -> bool:
        return self.client.send_raw({"type": "heartbeat", "seq": 0, "pad": "x" * (MAX_MESSAGE + 1024)})


def discover_for(inventory: Callable[[], HardwareInventory]) -> Callable[[], Any]:
    async def discover() -> HardwareInventory:
        return inventory()
    return discover
