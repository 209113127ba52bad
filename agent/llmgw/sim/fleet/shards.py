"""The simulated agent's shards: the agent's own supervisor, minus the engine processes.

``SimSupervisor`` is ``llmgw.agent.supervisor.Supervisor`` with the steps that
touch a process replaced by timed ones, so a start, a stop, a drain, a
re-sent start or a stop of an unknown shard is answered by the agent's own
code: the same state table (``shardstate``), the same ``shard_status`` and
``register`` reports, the same cancellation of a start still fetching.

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
watched and stopped by the unchanged supervisor code.
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

from llmgw.agent import procident
from llmgw.agent.fetch.progress import Snapshot
from llmgw.agent.procident import ProcessIdentity
from llmgw.agent.shardstate import ShardState
from llmgw.agent.statedir import ShardRecord, StateDir
from llmgw.agent.supervisor import Emit, Shard, Supervisor, SupervisorConfig

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


class SimStateDir:
    """The supervisor's state dir: nothing on disk for simulated shards.

    A real engine's record and log go to a real ``StateDir`` (created on first
    use), as the agent keeps them; a simulated shard's would only cost a
    write and an fsync per transition.
    """

    def __init__(self, root: Path | None):
        self.root_path = root
        self.real: set[str] = set()
        self._dir: StateDir | None = None

    @property
    def dir(self) -> StateDir:
        if self._dir is None:
            assert self.root_path is not None, "a real engine needs a state directory"
            self._dir = StateDir(self.root_path)
        return self._dir

    @property
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

    def log_tail(self, shard_id: str, max_bytes: int = 16384, since_marker: str | None = None) -> str:
        return self.dir.log_tail(shard_id, max_bytes, since_marker) if shard_id in self.real else ""


def supervisor_config(node_id: str, engine_command: tuple[str, ...], model_dir: str,
                      engine_ports: tuple[int, int]) -> SupervisorConfig:
    return SupervisorConfig(node_id=node_id, advertise_address="127.0.0.1", engine_bind_host="127.0.0.1",
                            engine_ports=engine_ports, engine_commands={"vllm": engine_command},
                            model_dir=model_dir, stop_grace=5.0, drain_grace=10.0)


class SimSupervisor(Supervisor):
    def __init__(self, config: SupervisorConfig, emit: Emit, timings: Timings, counters: Counters,
                 engines: EngineSample):
        statedir = SimStateDir(None if engines.root is None else engines.root / config.node_id)
        super().__init__(config, statedir, emit)  # type: ignore[arg-type]
        self.timings = timings
        self.counters = counters
        self.engines = engines
        self.sim_dir = statedir

    def _real(self, shard: Shard) -> bool:
        return shard.shard_id in self.sim_dir.real

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

    # ------------------------------------------------------------ the simulated steps
    async def _launch(self, shard: Shard) -> bool:
        if self._real(shard):
            ok = await super()._launch(shard)
            if ok:
                self.counters.engines += 1
            return ok
        spec = shard.spec
        checked = self._checked(shard)
        if checked is None:
            return False
        model = checked[0]
        if self.timings.fetch > 0:
            self._transition(shard, ShardState.FETCHING)
            if not await self._fetch(shard, model.source, model.size_bytes or self.timings.weights_bytes):
                return False
        rank, nnodes = int(spec["rank"]), int(spec["nnodes"])
        held = self._ports_held()
        free = (p for p in range(SIM_PORTS[0], SIM_PORTS[1] + 1) if p not in held)
        shard.port = next(free) if rank == 0 else None
        shard.master_port = next(free) if rank == 0 and nnodes > 1 else None
        shard.identity = ProcessIdentity(next(_pids), int(time.monotonic() * 100), procident.boot_id())
        self._transition(shard, ShardState.STARTING)
        return True

    async def _fetch(self, shard: Shard, source: str, total: int) -> bool:
        """``fetch`` seconds of download with progress; False (shard failed) past the start deadline."""
        began = time.monotonic()
        end = began + self.timings.fetch
        while True:
            now = time.monotonic()
            if now >= shard.deadline:
                timeout = float(shard.spec["profile"]["start_timeout"])
                self._fail_before_launch(shard, f"not ready within start_timeout ({timeout:g}s): still fetching "
                                                f"{source}")
                return False
            done = min(total, int(total * (now - began) / self.timings.fetch))
            rate = total / self.timings.fetch
            self.emit(Snapshot(done, total, rate).message(source, os.path.basename(source) or source,
                                                          [shard.shard_id]))
            self.counters.progress += 1
            if now >= end:
                return True
            await asyncio.sleep(min(self.timings.progress_interval, end - now, shard.deadline - now))

    async def _await_ready(self, shard: Shard) -> None:
        if self._real(shard):
            await super()._await_ready(shard)
            return
        remaining = shard.deadline - time.monotonic()
        await asyncio.sleep(max(0.0, min(self.timings.start, remaining)))
        if shard.state is not ShardState.STARTING or shard.end_intent is not None:
            return
        if self.timings.start > remaining:
            timeout = float(shard.spec["profile"]["start_timeout"])
            self._end(shard, ShardState.FAILED, f"not ready within start_timeout ({timeout:g}s)",
                      self.config.stop_grace)
            return
        self._transition(shard, ShardState.READY)

    def _watch_liveness(self, shard: Shard) -> None:
        # A synthetic shard has no engine to check; a real one is checked as on a node.
        if self._real(shard):
            super()._watch_liveness(shard)

    async def _terminate(self, shard: Shard) -> None:
        if self._real(shard):
            await super()._terminate(shard)
            return
        if shard.exited.is_set():
            return
        await asyncio.sleep(self.timings.stop)
        await self._conclude(shard, "exited with status 0")

    async def _reap_group(self, shard: Shard) -> None:
        if self._real(shard):
            await super()._reap_group(shard)

    def _tail(self, shard: Shard) -> str:
        return super()._tail(shard) if self._real(shard) else ""
