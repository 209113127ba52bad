"""A real Supervisor on the engine simulator, in process (no tests here): shard specs as the control
plane sends them, a recorder of what the supervisor reports, and a runner for each test's body."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from llmgw.agent.liveness import LivenessPolicy
from llmgw.agent.statedir import StateDir
from llmgw.agent.supervisor import Supervisor, SupervisorConfig
from llmgw.config import schema_errors
from tests.support.polling import until_async
from tests.support.ports import engine_port_block


WAIT = 90.0  # generous: a loaded 2-core machine must not turn slowness into failure


SIM = (sys.executable, "-m", "llmgw.sim.engine")


def make_spec(shard_id: str, *, timeout: float = 120, env: dict | None = None, gpus=(0,),
              source: str = "org/tiny", extra_args=(), api_key: str | None = None) -> dict:
    return {"api_key": api_key,
        "shard_id": shard_id, "replica_id": shard_id.split("/")[0],
        "model": {"name": "tiny", "source": source, "served_name": "tiny-served"},
        "profile": {"name": "sim", "engine": "vllm", "tensor_parallel_size": len(gpus), "pipeline_parallel_size": 1,
                    "nodes": 1, "extra_args": list(extra_args), "env": env or {}, "start_timeout": timeout},
        "rank": 0, "nnodes": 1, "gpu_indices": list(gpus), "env": {},
    }


class Harness:
    def __init__(self, tmp_path: Path, command=SIM, stop_grace: float = 15.0, drain_grace: float = 120.0,
                 bind_host: str = "127.0.0.1", health: LivenessPolicy = LivenessPolicy()):
        self.statedir = StateDir(tmp_path / "state")
        first = engine_port_block(200)
        self.config = SupervisorConfig(
            node_id=f"n-{os.getpid()}", advertise_address="127.0.0.1", engine_bind_host=bind_host,
            engine_ports=(first, first + 199), engine_commands={"vllm": tuple(command)},
            model_dir=str(tmp_path / "models"), stop_grace=stop_grace, drain_grace=drain_grace,
            probe_interval=0.2, health=health)
        self.messages: list[dict] = []
        self.sup: Supervisor | None = None

    def emit(self, msg: dict) -> None:
        errors = schema_errors(msg, "stream")
        assert not errors, f"emitted message fails the stream schema: {errors}: {msg}"
        self.messages.append(msg)

    def states(self, shard_id: str) -> list[str]:
        return [m["state"] for m in self.messages if m["shard_id"] == shard_id]

    def last(self, shard_id: str) -> dict:
        return [m for m in self.messages if m["shard_id"] == shard_id][-1]

    async def until(self, pred, what: str, timeout: float = WAIT) -> None:
        await until_async(pred, what, timeout, on_timeout=lambda: f"messages: {self.messages}")

    async def terminal(self, shard_id: str, timeout: float = WAIT) -> dict:
        await self.until(lambda: any(s in ("failed", "stopped") for s in self.states(shard_id)),
                         f"{shard_id} to end", timeout)
        return self.last(shard_id)


def run(tmp_path, body, **kw):
    async def main():
        h = Harness(tmp_path, **kw)
        h.sup = Supervisor(h.config, h.statedir, h.emit)
        try:
            await body(h, h.sup)
        finally:
            for s in h.sup.live_shards():  # leave nothing running behind a failed assertion
                if s.launched:
                    await h.sup.stop(s.shard_id, "test cleanup")
            await h.sup.detach()
    asyncio.run(main())


def multinode(spec: dict, rank: int, master_port: int | None = None) -> dict:
    spec["profile"]["nodes"] = 2
    spec["profile"]["tensor_parallel_size"] = 2
    spec.update(nnodes=2, rank=rank, master_addr=None if rank == 0 else "127.0.0.1", master_port=master_port)
    return spec
