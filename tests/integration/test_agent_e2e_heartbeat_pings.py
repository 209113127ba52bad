"""Heartbeats stand in for pings: a real agent and ``llmgw server``, and a hand-written stream client.

The control plane says ``answers_heartbeats``; from then the agent sends no
WebSocket ping while its heartbeats go out, and the control plane sends a
frame back (an unsolicited pong) at least every keepalive interval, so the
agent's stream outlives many ping intervals plus the grace without a single
ping.  A client that pings, as agents of the previous release do, still gets
its pongs.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from fleet import FAST_LIFECYCLE, Fleet, metric_samples, register_message, until
from llmgw.tls.context import client_context

pytestmark = pytest.mark.integration

STREAM = "/v1/agent/stream"
SILENCE_DROPS_AFTER = FAST_LIFECYCLE["keepalive_interval"] + FAST_LIFECYCLE["stream_grace"]


def keepalive_frames(f: Fleet) -> float:
    return metric_samples(f)["llmgw_stream_keepalive_frames_total"][0][1]


def test_a_real_agent_sends_no_pings_while_heartbeats_flow_and_keeps_its_stream(tmp_path):
    with Fleet(tmp_path, nodes={"a": 1}, replicas=0) as f:
        f.start()
        node, agent = f.node_ids["a"], f.agents["a"]
        first = until(lambda: (n := f.try_node("a")) and n["connected"] and n, "the agent to register",
                      on_timeout=f.dump)
        before = keepalive_frames(f)
        since = time.monotonic()
        # longer than a ping interval plus the grace: a stream with no word from the control plane is dropped
        until(lambda: time.monotonic() - since > SILENCE_DROPS_AFTER + 1, "the stream to outlive the grace")
        now = f.nodes()[node]
        assert now["connected"] and now["epoch"] == first["epoch"], "the stream was kept: no redial"
        assert keepalive_frames(f) == before, "no ping read from an agent whose heartbeats flow"
        assert "dropping the stream" not in agent.output()
        assert "the control plane answers heartbeats" in agent.output()


def test_the_control_plane_answers_heartbeats_and_still_answers_pings(tmp_path):
    with Fleet(tmp_path, nodes={}, replicas=0) as f:
        f.start()
        url = f.url.replace("https", "wss") + STREAM
        node = f"node-hb-{f.suffix}"
        got: list[str] = []

        async def scenario() -> None:
            ctx = client_context(f.pki.ca_cert, *f.pki.node(node))
            async with aiohttp.ClientSession() as s, s.ws_connect(url, ssl=ctx, autoping=False) as ws:
                await ws.send_str(json.dumps(register_message(node)))
                seq = 0

                async def heartbeats() -> None:
                    nonlocal seq
                    while True:
                        await ws.send_str(json.dumps({"type": "heartbeat", "seq": seq, "time": time.time()}))
                        seq += 1
                        await asyncio.sleep(FAST_LIFECYCLE["heartbeat_interval"])

                beating = asyncio.create_task(heartbeats())
                try:
                    while got.count("pong") < 2:  # unsolicited: this client never pinged
                        msg = await asyncio.wait_for(ws.receive(), 30)
                        assert msg.type in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.PONG), msg
                        got.append(json.loads(msg.data)["type"] if msg.type == aiohttp.WSMsgType.TEXT else "pong")
                    await ws.ping(b"old agent")  # as an agent of the previous release does
                    while True:
                        msg = await asyncio.wait_for(ws.receive(), 30)
                        if msg.type == aiohttp.WSMsgType.PONG and msg.data == b"old agent":
                            break
                finally:
                    beating.cancel()

        asyncio.run(scenario())
        assert got[:3] == ["registered", "liveness", "accepts"] and "answers_heartbeats" in got[3:5], got
