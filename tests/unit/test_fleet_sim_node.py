"""A simulated agent's fault switches on top of the agent's own stream client."""

from __future__ import annotations

import asyncio
from collections import Counter

from llmgw.hardware.types import HardwareInventory
from llmgw.sim.fleet.node import MALFORMED, SimStreamClient
from llmgw.sim.fleet.shards import Counters, EngineSample, SimSupervisor, Timings, supervisor_config


def client() -> SimStreamClient:
    async def discover() -> HardwareInventory:
        return HardwareInventory(node_id="sim-00000", gpus=(), gpu_source="simulated")

    sup = SimSupervisor(supervisor_config("sim-00000", ("/bin/false",), "/nonexistent", (40000, 40099)),
                        lambda m: None, Timings(), Counters(), EngineSample(0, (), None))
    return SimStreamClient(sent=Counter(), url="wss://127.0.0.1:1/v1/agent/stream", node_id="sim-00000",
                           address="127.0.0.1", ssl_context=None, supervisor=sup, discover=discover,
                           reconnect_initial=1.0, reconnect_max=2.0)


def test_silence_drops_heartbeats_and_holds_the_rest_until_heal() -> None:
    async def run():
        c = client()
        c._queue = asyncio.Queue()  # as while connected
        c.send({"type": "heartbeat", "seq": 0})
        c.silenced = True
        c.send({"type": "heartbeat", "seq": 1})
        c.send({"type": "shard_status", "shard_id": "r/r0", "state": "ready"})
        held = c._queue.qsize()
        c.heal()
        out = [c._queue.get_nowait() for _ in range(c._queue.qsize())]
        return c, held, out
    c, held, out = asyncio.run(run())
    assert held == 1  # only the heartbeat sent before the silence
    assert [m["type"] for m in out] == ["heartbeat", "shard_status"] and out[0]["seq"] == 0
    assert c.sent == Counter({"heartbeat": 1, "shard_status": 1})


def test_bad_messages_need_a_connection_and_count_as_sent() -> None:
    async def run():
        c = client()
        before = c.send_raw(dict(MALFORMED))
        c._queue = asyncio.Queue()
        after = c.send_raw(dict(MALFORMED))
        return c, before, after
    c, before, after = asyncio.run(run())
    assert (before, after) == (False, True) and c.sent["shard_status"] == 1


def test_agents_of_a_process_share_one_backoff_rng() -> None:
    async def run():
        return client(), client()
    a, b = asyncio.run(run())
    assert a.backoff.rng is b.backoff.rng
