"""An agent's supervisor that fetches weights before it starts an engine (no tests here): the
messages it sent, and waits on them."""

from __future__ import annotations

import os
import time
from pathlib import Path

from llmgw.agent.statedir import StateDir
from llmgw.agent.supervisor import Supervisor, SupervisorConfig
from llmgw.config import schema_errors
from llmgw.settings import FetchPolicy
from tests.support.polling import until_async
from tests.support.ports import engine_port_block


WAIT = 90.0


SLEEPER = ("/bin/sh", "-c", "exec sleep 60", "engine")


class Agent:
    def __init__(self, tmp_path: Path, policy: FetchPolicy):
        first = engine_port_block(200)
        self.config = SupervisorConfig(
            node_id=f"n-{os.getpid()}", advertise_address="127.0.0.1", engine_bind_host="127.0.0.1",
            engine_ports=(first, first + 199), engine_commands={"vllm": SLEEPER},
            model_dir=str(tmp_path / "models"), stop_grace=5, probe_interval=0.2, fetch=policy)
        self.sup = Supervisor(self.config, StateDir(tmp_path / "state"), self.emit)
        self.status: list[dict] = []
        self.progress: list[dict] = []
        self.on_progress = None
        self.order: list[tuple[float, str]] = []  # (monotonic time, "progress" or the state reported)

    def emit(self, msg: dict) -> None:
        if msg["type"] != "progress" or len(self.progress) % 500 == 0:  # validating all 10,000 would be the test's cost
            errors = schema_errors(msg, "stream")
            assert not errors, f"emitted message fails the stream schema: {errors}: {msg}"
        self.order.append((time.monotonic(), "progress" if msg["type"] == "progress" else msg.get("state", "?")))
        if msg["type"] == "progress":
            self.progress.append(msg)
            if self.on_progress:
                self.on_progress(len(self.progress))
        else:
            self.status.append(msg)

    def states(self, sid: str) -> list[str]:
        return [m["state"] for m in self.status if m["shard_id"] == sid]

    async def until(self, pred, what: str, timeout: float = WAIT) -> None:
        await until_async(pred, what, timeout, on_timeout=lambda: f"status: {self.status}", interval=0.02)

    async def close(self) -> None:
        for s in self.sup.live_shards():
            await self.sup.stop(s.shard_id, "test cleanup")
        await self.sup.detach()
