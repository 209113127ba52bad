"""One shard as the supervisor and its engine drivers see it, and the supervisor's configuration.

Apart from ``supervisor.py`` so that a driver (``driver.py``) can be written
against the shard it runs without importing the supervisor that calls it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from llmgw.agent import liveness
from llmgw.agent.procident import ProcessIdentity
from llmgw.agent.shardstate import ShardState
from llmgw.catalog import KVTransfer, Model, Profile
from llmgw.settings import EngineTLS, FetchPolicy


@dataclass(frozen=True)
class SupervisorConfig:
    node_id: str
    advertise_address: str
    engine_bind_host: str
    engine_ports: tuple[int, int]
    engine_commands: dict[str, tuple[str, ...]]
    model_dir: str
    allow_keyless_engines: bool = False  # agent.yaml: launch without an engine key on a non-loopback bind
    stop_grace: float = 15.0  # SIGTERM -> SIGKILL on stop
    drain_grace: float = 120.0  # SIGTERM -> SIGKILL on drain: in-flight requests finish
    poll_interval: float = 0.5  # adopted-engine liveness, group-empty checks
    probe_interval: float = 1.0
    probe_timeout: float = 10.0
    tail_bytes: int = 16384
    fetch: FetchPolicy = FetchPolicy()  # downloading URL sources (agent.yaml ``fetch``)
    health: liveness.LivenessPolicy = liveness.LivenessPolicy()  # Ready shards (agent.yaml ``health``)
    engine_tls: EngineTLS | None = None  # agent.yaml ``engine_tls``: engines that can serve HTTPS do
    engine_ca: str | None = None  # the fleet CA (agent.yaml ``tls.ca``) the probes verify engines against

    @classmethod
    def from_settings(cls, settings: Any, **overrides: Any) -> "SupervisorConfig":
        return cls(
            node_id=settings.node_id,
            advertise_address=settings.advertise_address,
            engine_bind_host=settings.engine_bind_host,
            engine_ports=tuple(settings.engine_ports),
            engine_commands=dict(settings.engine_commands),
            model_dir=settings.model_dir,
            allow_keyless_engines=settings.allow_keyless_engines,
            fetch=settings.fetch,
            health=settings.health,
            engine_tls=settings.engine_tls,
            engine_ca=settings.tls.ca if settings.tls is not None else None,
            **overrides,
        )


@dataclass
class Shard:
    """In-memory state of one shard; ``record`` is what is on disk."""

    spec: dict[str, Any]
    state: ShardState
    started_at: float
    deadline: float  # time.monotonic() value
    adopted: bool = False
    identity: ProcessIdentity | None = None
    handle: Any = None  # the driver's own hold on the engine it launched (``PopenDriver``: the Popen)
    port: int | None = None
    master_port: int | None = None
    side_port: int | None = None  # a prefill/decode replica's KV-transfer side channel (held like the others)
    argv: tuple[str, ...] = ()
    tls: bool = False  # rank 0 serves HTTPS (with the node's engine certificate)
    launch_marker: str = ""
    log_offset: int | None = None  # size of the engine's log at launch: this life's output follows
    # Set by whoever decides the engine must end (stop, drain, timeout): the
    # terminal state and reason the watch task reports once it has.
    end_intent: tuple[ShardState, str] | None = None
    exited: asyncio.Event = field(default_factory=asyncio.Event)  # the leader is gone
    # ... and its group reaped and the terminal state reported: what a stop waits for.
    concluded: asyncio.Event = field(default_factory=asyncio.Event)
    exit_desc: str = ""
    lifecycle: asyncio.Task[None] | None = None
    watcher: asyncio.Task[None] | None = None
    stopper: asyncio.Task[None] | None = None
    monitor: asyncio.Task[None] | None = None  # liveness checks while Ready
    checks: int = 0  # liveness checks made (for logs and tests)
    checks_failed: int = 0
    kill_at: float | None = None  # time.monotonic() at which a stopping engine gets SIGKILL
    kill_changed: asyncio.Event = field(default_factory=asyncio.Event)
    last_probe: str = ""
    engine_version: str | None = None  # what rank 0 says it is, read once after Ready
    sleeping: bool = False  # scale to sleep: the engine answered /sleep (agent/enginesleep.py), not yet /wake_up

    @property
    def shard_id(self) -> str:
        return str(self.spec["shard_id"])

    @property
    def rank(self) -> int:
        return int(self.spec.get("rank", 0))

    @property
    def launched(self) -> bool:
        return self.identity is not None

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"


def spec_model(spec: dict[str, Any]) -> Model:
    m = spec["model"]
    return Model(name=m["name"], source=m["source"], served_name=m["served_name"],
                 size_bytes=m.get("size_bytes"), sha256=m.get("sha256"), max_model_len=m.get("max_model_len"),
                 hub_endpoint=m.get("hub_endpoint"))


def spec_profile(spec: dict[str, Any]) -> Profile:
    p = spec["profile"]
    return Profile(
        name=p["name"], engine=p["engine"],
        tensor_parallel_size=int(p["tensor_parallel_size"]),
        pipeline_parallel_size=int(p["pipeline_parallel_size"]),
        nodes=int(p["nodes"]),
        extra_args=tuple(p.get("extra_args", ())),
        env=tuple(sorted(p.get("env", {}).items())),
        start_timeout=float(p["start_timeout"]),
        max_concurrency=p.get("max_concurrency"),
        kv_events=bool(p.get("kv_events", False)),
        kv_transfer=KVTransfer.from_dict(p["kv_transfer"]) if p.get("kv_transfer") else None,
    )
