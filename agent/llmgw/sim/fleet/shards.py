"""The simulated agent's shards: the agent's own supervisor, driving timed engines.

``SimSupervisor`` is ``llmgw.agent.supervisor.Supervisor`` given
``TimedEngines`` as its engine driver (``llmgw.agent.driver``), so a start, a
stop, a drain, a re-sent start or a stop of an unknown shard is answered by
the agent's own code: the same state table (``shardstate``), the same
``shard_status`` and ``register`` reports, the same cancellation of a start
still fetching.  Nothing private of the supervisor is overridden or called
(``tests/unit/test_agent_driver_seam.py`` fails if it is), so a change to the
supervisor reaches the simulator through the driver interface or not at all.

What is simulated, and how long it takes (``Timings``):

* fetching: every start spends ``fetch`` seconds in ``fetching``, sending a
  ``progress`` message (the fetcher's own format) every ``progress_interval``;
* launching: no process; the shard reports a synthetic process identity
  (pid counted up from ``SYNTHETIC_PID``, above Linux's largest pid, so it can
  never name a real process of the host), a port, and a rendezvous port for
  rank 0 of a multi-node replica, exactly the fields a real launch reports;
* readiness after ``start`` seconds (a start that cannot be ready within the
  profile's ``start_timeout`` fails as the real one does);
* a stop or drain ends after ``stop`` seconds.

A shard picked by ``EngineSample`` runs the real path instead: a real
``llmgw-engine-sim`` process launched through the engine adapter, probed,
watched and stopped by the agent's own ``PopenDriver``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmgw.agent import liveness, procident
from llmgw.agent.driver import ExitReport, LaunchSteps, Readiness, Started
from llmgw.agent.fetch.progress import Snapshot
from llmgw.agent.popendriver import PopenDriver
from llmgw.agent.procident import ProcessIdentity
from llmgw.agent.shardstate import ShardState
from llmgw.agent.statedir import ShardRecord, ShardStore, StateDir
from llmgw.agent.supervisor import Emit, Shard, Supervisor, SupervisorConfig
from llmgw.catalog import Model, Profile

log = logging.getLogger(__name__)

SYNTHETIC_PID = 10_000_000  # > 4194304, the largest pid_max Linux allows
SIM_PORTS = (20000, 29999)  # synthetic engine ports (real sampled engines use their own range)
_pids = itertools.count(SYNTHETIC_PID)


@dataclass(frozen=True)
class Timings:
    fetch: float = 0.0
    start: float = 0.5
    stop: float = 0.2
    progress_interval: float = 1.0
    weights_bytes: int = 16 << 30  # reported when the model declares no size


@dataclass
class Counters:
    """What every simulated supervisor of one process adds to (for the status)."""

    starts: int = 0
    stops: int = 0
    drains: int = 0
    progress: int = 0
    replicas: set[str] = field(default_factory=set)  # replica ids that got a rank-0 start
    engines: int = 0  # real engine processes launched


class EngineSample:
    """Which shards run a real engine: rank 0 of the first ``k`` single-node vLLM replicas seen
    (of ``models`` only, when given, so a model can be served by real engines alone)."""

    def __init__(self, k: int, command: tuple[str, ...], root: Path | None, models: tuple[str, ...] = ()):
        self.left = k
        self.command = command
        self.root = root
        self.models = frozenset(models)
        self.taken: set[str] = set()

    def take(self, spec: dict[str, Any]) -> bool:
        rid = str(spec["replica_id"])
        if rid in self.taken:
            return True
        if self.left <= 0 or int(spec["rank"]) != 0 or int(spec["nnodes"]) != 1 \
                or spec["profile"]["engine"] != "vllm" \
                or (self.models and spec["model"]["name"] not in self.models):
            return False
        self.left -= 1
        self.taken.add(rid)
        return True


class SimStateDir(ShardStore):
    """The supervisor's state dir: nothing on disk for simulated shards.

    A real engine's record and log go to a real ``StateDir`` (created on first
    use), as the agent keeps them; a simulated shard's would only cost a
    write and an fsync per transition.
    """

    def __init__(self, root: Path | None):
        self.root_path = root
        self.real: set[str] = set()
        self.disk: StateDir | None = None

    @property
    def dir(self) -> StateDir:
        if self.disk is None:
            assert self.root_path is not None, "a real engine needs a state directory"
            self.disk = StateDir(self.root_path)
        return self.disk

    @property  # type: ignore[override]
    def root(self) -> Path:
        return self.dir.root

    def write(self, record: ShardRecord) -> None:
        if record.shard_id in self.real:
            self.dir.write(record)

    def remove(self, shard_id: str) -> None:
        if shard_id in self.real:
            self.dir.remove(shard_id)

    def log_note(self, shard_id: str, line: str) -> None:
        if shard_id in self.real:
            self.dir.log_note(shard_id, line)

    def secret_dir(self, shard_id: str) -> Path:
        """Key files are written for real engines only (SGLang's --config)."""
        return self.dir.secret_dir(shard_id)

    def remove_secrets(self, shard_id: str) -> None:
        if shard_id in self.real:
            self.dir.remove_secrets(shard_id)

    def open_log(self, shard_id: str) -> int:
        return self.dir.open_log(shard_id)

    def log_tail(self, shard_id: str, max_bytes: int = 16384, since_offset: int | None = None,
                 since_marker: str | None = None) -> str:
        if shard_id not in self.real:
            return ""
        return self.dir.log_tail(shard_id, max_bytes, since_offset=since_offset, since_marker=since_marker)


def supervisor_config(node_id: str, engine_command: tuple[str, ...], model_dir: str,
                      engine_ports: tuple[int, int]) -> SupervisorConfig:
    return SupervisorConfig(node_id=node_id, advertise_address="127.0.0.1", engine_bind_host="127.0.0.1",
                            engine_ports=engine_ports, engine_commands={"vllm": engine_command},
                            model_dir=model_dir, stop_grace=5.0, drain_grace=10.0)


class TimedEngines:
    """The simulator's engine driver: timed steps for simulated shards, ``PopenDriver`` for sampled real ones.

    A simulated engine has no process to watch: it ends only when stopped,
    ``stop`` seconds after being asked, and reports that exit itself.
    """

    def __init__(self, config: SupervisorConfig, statedir: SimStateDir, timings: Timings, counters: Counters):
        self.statedir = statedir
        self.timings = timings
        self.counters = counters
        self.popen = PopenDriver(config, statedir)

    def is_real(self, shard: Shard) -> bool:
        return shard.shard_id in self.statedir.real

    # ------------------------------------------------------------ launch
    async def prepare(self, shard: Shard, model: Model, steps: LaunchSteps) -> str | None:
        if self.is_real(shard):
            return await self.popen.prepare(shard, model, steps)
        if self.timings.fetch > 0:
            steps.fetching(shard)
            if not await self._fetch(shard, steps, model.source, model.size_bytes or self.timings.weights_bytes):
                return None
        return model.source

    async def _fetch(self, shard: Shard, steps: LaunchSteps, source: str, total: int) -> bool:
        """``fetch`` seconds of download with progress; False (shard failed) past the start deadline."""
        began = time.monotonic()
        end = began + self.timings.fetch
        while True:
            now = time.monotonic()
            if now >= shard.deadline:
                timeout = float(shard.spec["profile"]["start_timeout"])
                steps.fail_before_launch(shard, f"not ready within start_timeout ({timeout:g}s): still fetching "
                                                f"{source}")
                return False
            done = min(total, int(total * (now - began) / self.timings.fetch))
            rate = total / self.timings.fetch
            steps.emit(Snapshot(done, total, rate).message(source, os.path.basename(source) or source,
                                                           [shard.shard_id]))
            self.counters.progress += 1
            if now >= end:
                return True
            await asyncio.sleep(min(self.timings.progress_interval, end - now, shard.deadline - now))

    def start(self, shard: Shard, model: Model, profile: Profile, model_path: str,
              ports_held: set[int]) -> Started:
        if self.is_real(shard):
            started = self.popen.start(shard, model, profile, model_path, ports_held)
            self.counters.engines += 1
            return started
        rank, nnodes = int(shard.spec["rank"]), int(shard.spec["nnodes"])
        free = (p for p in range(SIM_PORTS[0], SIM_PORTS[1] + 1) if p not in ports_held)
        port = next(free) if rank == 0 else None
        master_port = next(free) if rank == 0 and nnodes > 1 else None
        identity = ProcessIdentity(next(_pids), int(time.monotonic() * 100), procident.boot_id())
        return Started(identity=identity, port=port, master_port=master_port)

    def watch(self, shard: Shard, exited: ExitReport) -> asyncio.Task[None] | None:
        return self.popen.watch(shard, exited) if self.is_real(shard) else None

    def recover(self, shard: Shard, exited: ExitReport) -> asyncio.Task[None]:
        return self.popen.recover(shard, exited)

    # ------------------------------------------------------------ readiness and liveness
    async def wait_ready(self, shard: Shard) -> Readiness:
        if self.is_real(shard):
            return await self.popen.wait_ready(shard)
        remaining = shard.deadline - time.monotonic()
        await asyncio.sleep(max(0.0, min(self.timings.start, remaining)))
        if shard.state is not ShardState.STARTING or shard.end_intent is not None:
            return Readiness.ENDED
        return Readiness.TIMED_OUT if self.timings.start > remaining else Readiness.READY

    def health_checked(self, shard: Shard) -> bool:
        # A synthetic shard has no engine to check; a real one is checked as on a node.
        return self.is_real(shard)

    async def check(self, shard: Shard, before: liveness.Progress | None) -> liveness.Check:
        return await self.popen.check(shard, before)

    # ------------------------------------------------------------ ending
    async def stop(self, shard: Shard, exited: ExitReport) -> None:
        if self.is_real(shard):
            await self.popen.stop(shard, exited)
            return
        if shard.exited.is_set():
            return
        await asyncio.sleep(self.timings.stop)
        await exited(shard, "exited with status 0")

    async def reap(self, shard: Shard) -> None:
        if self.is_real(shard):
            await self.popen.reap(shard)

    def tail(self, shard: Shard) -> str:
        return self.popen.tail(shard) if self.is_real(shard) else ""

    async def close(self) -> None:
        await self.popen.close()


class SimSupervisor(Supervisor):
    """The agent's supervisor with ``TimedEngines``, counting what it is asked to do."""

    def __init__(self, config: SupervisorConfig, emit: Emit, timings: Timings, counters: Counters,
                 engines: EngineSample):
        statedir = SimStateDir(None if engines.root is None else engines.root / config.node_id)
        super().__init__(config, statedir, emit, TimedEngines(config, statedir, timings, counters))
        self.timings = timings
        self.counters = counters
        self.engines = engines
        self.sim_dir = statedir

    # ------------------------------------------------------------ commands
    def start(self, spec: dict[str, Any]) -> Shard:
        self.counters.starts += 1
        if int(spec.get("rank", 0)) == 0:
            self.counters.replicas.add(str(spec["replica_id"]))
        cur = self.shards.get(str(spec["shard_id"]))
        if (cur is None or cur.state.terminal) and self.engines.take(spec):
            self.sim_dir.real.add(str(spec["shard_id"]))
        return super().start(spec)

    async def stop(self, shard_id: str, reason: str = "stop requested", *, drain: bool = False) -> None:
        if drain:
            self.counters.drains += 1
        else:
            self.counters.stops += 1
        await super().stop(shard_id, reason, drain=drain)

    def adopt_all(self) -> None:
        """A restarted agent adopts what the previous one ran: report every live shard as adopted."""
        for s in self.live_shards():
            s.adopted = True
