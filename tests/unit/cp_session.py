"""A control plane's side of the agent stream, in process (no tests here): the session the agent
talks to, its register message and server settings."""

from __future__ import annotations

from llmgw.agent.statedir import StateDir
from llmgw.agent.stream import StreamClient
from llmgw.agent.supervisor import Supervisor, SupervisorConfig
from llmgw.hardware.types import HardwareInventory
from llmgw.settings import parse_server_settings


def register_message(settings, hw: HardwareInventory) -> dict:
    sup = Supervisor(SupervisorConfig.from_settings(settings), StateDir(settings.state_dir), lambda m: None)
    client = StreamClient(url=settings.control_plane_url, node_id=settings.node_id, address="127.0.0.1",
                          ssl_context=None, supervisor=sup, discover=lambda: None,  # type: ignore[arg-type]
                          reconnect_initial=1, reconnect_max=2)
    return client.register_message(hw)


def server_settings():
    return parse_server_settings({
        "api": {"listen": {"port": 8443}}, "insecure_no_tls": True,
        "lifecycle": {"heartbeat_interval": 1, "keepalive_interval": 1, "unreachable_after": 3,
                      "lost_after": 6, "startup_grace": 0},
        "models": [{"name": "tiny", "source": "org/tiny"}],
        "profiles": [{"name": "sim", "engine": "vllm", "tensor_parallel_size": 2}],
        "deployments": [{"model": "tiny", "profile": "sim", "replicas": 1}],
    })


class Session:
    def __init__(self) -> None:
        self.epoch = 0
        self.sent: list[dict] = []

    def send(self, msg: dict) -> bool:
        self.sent.append(msg)
        return True

    def close(self, reason: str) -> None:
        pass
