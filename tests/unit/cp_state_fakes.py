"""Fakes for the control plane's state tests (no tests here): a clock that moves when told and a
session that records what was sent."""

from __future__ import annotations

from typing import Any

from llmgw.controlplane.messages import parse_up
from llmgw.hardware.types import GPU, HardwareInventory
from llmgw.settings import parse_server_settings


GIB = 1 << 30


def settings(replicas: int = 1, **lifecycle: float):
    return parse_server_settings({
        "api": {"listen": {"port": 8443}},
        "insecure_no_tls": True,
        "lifecycle": {"heartbeat_interval": 1, "keepalive_interval": 1, "unreachable_after": 3,
                      "lost_after": 6, "startup_grace": 0, **lifecycle},
        "models": [{"name": "tiny", "source": "org/tiny"}],
        "profiles": [{"name": "sim", "engine": "vllm"}],
        "deployments": [{"model": "tiny", "profile": "sim", "replicas": replicas}],
    })


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class FakeSession:
    def __init__(self) -> None:
        self.epoch = 0
        self.sent: list[dict[str, Any]] = []
        self.closed: str | None = None

    def send(self, msg: dict[str, Any]) -> bool:
        if self.closed:
            return False
        self.sent.append(msg)
        return True

    def close(self, reason: str) -> None:
        self.closed = reason


def register(node_id: str, shards: list | None = None) -> dict[str, Any]:
    hw = HardwareInventory(node_id=node_id, gpu_source="simulated",
                           gpus=(GPU(0, "GPU-0", "Sim", 80 * GIB, "00000000:01:00.0"),)).to_dict()
    msg = {"type": "register", "node_id": node_id, "agent_version": "t", "boot_id": "b", "address": "10.0.0.9",
           "hardware": hw, "shards": shards or []}
    assert parse_up(__import__("json").dumps(msg)) == msg
    return msg
