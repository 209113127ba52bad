"""Heartbeats stand in for pings: the agent's rule for when to ping, and the control plane's for when to answer.

Over real processes in tests/integration/test_agent_e2e_heartbeat_pings.py.
"""

from __future__ import annotations

import asyncio
import time

from llmgw.agent.stream import StreamClient, incoming_problems
from llmgw.controlplane.agentservice import StreamSession


def client() -> StreamClient:
    return StreamClient(url="wss://cp:8443/v1/agent/stream", node_id="gpu-n1", address="10.0.0.7",
                        ssl_context=None, supervisor=None, discover=None, reconnect_initial=1,  # type: ignore[arg-type]
                        reconnect_max=2, keepalive=10.0)


def test_answers_heartbeats_is_a_downstream_message_of_its_own():
    assert incoming_problems({"type": "answers_heartbeats"}) == []
    assert incoming_problems({"type": "answers_heartbeats", "every": 3})


def test_the_agent_pings_unless_a_heartbeat_the_control_plane_answers_went_out_within_a_ping_interval():
    c = client()
    c._last_heartbeat = time.monotonic()
    assert c._ping_due(), "a control plane that did not say it answers heartbeats (an older one) is pinged"
    c._handle_text('{"type": "answers_heartbeats"}')
    assert not c._ping_due(), "a heartbeat just went out: it stands in for the ping"
    c._last_heartbeat = time.monotonic() - 10.0
    assert c._ping_due(), "no heartbeat for a ping interval (held back, or a longer heartbeat interval): ping"
    c._last_heartbeat = None
    assert c._ping_due()


class Ws:
    def __init__(self) -> None:
        self.sent: list[str] = []
        self.closed = False

    async def pong(self, data: bytes = b"") -> None:
        self.sent.append("pong")

    async def send_str(self, data: str) -> None:
        self.sent.append(data)


def test_the_control_plane_answers_a_heartbeat_only_when_nothing_went_back_for_a_keepalive_interval():
    async def scenario() -> list[str]:
        ws = Ws()
        s = StreamSession(ws, "n1", None)  # type: ignore[arg-type]
        s.heartbeat()  # an agent that was not told answers_heartbeats: its pings are answered instead
        s.answer_every = 1.0
        s.heartbeat()  # something went back less than a keepalive interval ago (the session just began)
        s.last_word = time.monotonic() - 1.0
        s.heartbeat()
        s.heartbeat()  # once per interval, not once per heartbeat
        await asyncio.sleep(0.05)
        s.send({"type": "stop", "shard_id": "x/r0"})
        s.last_word -= 0.5  # a message half an interval ago is a word too
        s.heartbeat()
        await asyncio.sleep(0.05)
        await s.stop()
        return ws.sent

    sent = asyncio.run(scenario())
    assert sent[0] == "pong" and len(sent) == 2 and '"stop"' in sent[1], sent
