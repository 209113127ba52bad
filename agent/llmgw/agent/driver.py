"""The seam between the supervisor and whatever runs an engine.

The supervisor (``supervisor.py``) owns a shard's lifecycle: the state table,
the start deadline, the reports, the record on disk, when an engine must end
and what its end is reported as.  An ``EngineDriver`` owns the engine: it
launches one and hands back what identifies it, says when it is ready or has
exited, stops it with a grace, takes over one a previous agent launched, and
tails its output.  The shape is Nomad's task driver (start -> handle, wait,
stop with a grace, recover by handle).

``PopenDriver`` (``popendriver.py``) runs engines as process groups on this
node; the fleet simulator's timed engine is another driver, so the simulator
runs the supervisor unchanged instead of overriding its steps.

Every driver method is called on the agent's event loop, with the ``Shard``
the supervisor keeps: a driver reads it (spec, identity, deadline,
``exited``, ``end_intent``, ``kill_at``) and changes only ``last_probe`` and
``kill_changed``; what it launched reaches the shard through ``Started``.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Protocol

from llmgw.agent import liveness
from llmgw.agent.procident import ProcessIdentity
from llmgw.agent.shard import Shard
from llmgw.catalog import Model, Profile

Emit = Callable[[dict[str, Any]], None]

# How a driver reports that an engine's leader exited, with a description of
# how ("exited with status 1", "was killed by SIGKILL"): the supervisor's
# conclusion (reap, then one terminal report).  Awaited at most once per launch.
ExitReport = Callable[[Shard, str], Awaitable[None]]


class LaunchRefused(Exception):
    """The engine cannot be launched; the message is the shard's failure reason."""


@dataclass(frozen=True)
class Started:
    """What a launch gives the supervisor to report and persist (the handle, in Nomad's terms)."""

    identity: ProcessIdentity
    port: int | None  # rank 0's HTTP port; None for ranks that serve none
    master_port: int | None = None  # rank 0 of a multi-node replica: the rendezvous port
    argv: tuple[str, ...] = ()
    tls: bool = False  # rank 0 serves HTTPS
    launch_marker: str = ""
    log_offset: int | None = None  # the engine's log size at launch: this life's output follows
    handle: Any = None  # the driver's own (kept on the shard, never persisted)
    side_port: int | None = None  # a prefill/decode replica's KV-transfer side channel


class Readiness(enum.Enum):
    READY = "ready"  # the engine serves: report Ready
    TIMED_OUT = "timed out"  # the start deadline passed first: end the engine, failed
    ENDED = "ended"  # the engine exited, or is being ended, or the shard moved on: nothing to do


class LaunchSteps(Protocol):
    """What the supervisor lets a driver do to a shard before its engine runs."""

    emit: Emit  # progress messages (the fetcher's format)

    def fetching(self, shard: Shard) -> None:
        """Report the shard ``fetching``."""
        ...

    def fail_before_launch(self, shard: Shard, reason: str) -> None:
        """Report the shard ``failed`` with ``reason`` (nothing was launched)."""
        ...

    async def fetch_weights(self, shard: Shard, model: Model) -> str | None:
        """The agent's own weights step: the model's local path, or None after failing the shard."""
        ...


class EngineDriver(Protocol):
    async def prepare(self, shard: Shard, model: Model, steps: LaunchSteps) -> str | None:
        """Make the weights available: the path to hand the engine, or None after failing the shard."""
        ...

    def start(self, shard: Shard, model: Model, profile: Profile, model_path: str,
              ports_held: set[int]) -> Started:
        """Launch the engine (raise ``LaunchRefused`` with the reason when it cannot be).

        Synchronous on purpose: a stop that arrives while a shard is not yet
        launched cancels its start, which must then have nothing running.
        """
        ...

    def watch(self, shard: Shard, exited: ExitReport) -> asyncio.Task[None] | None:
        """After ``start``: the task that awaits ``exited`` once the engine's leader is gone.

        None from a driver whose engines end only when stopped (it reports the
        exit from ``stop``).
        """
        ...

    def recover(self, shard: Shard, exited: ExitReport) -> asyncio.Task[None]:
        """Take over an engine launched by a previous agent (``shard.identity``, verified): its watch task."""
        ...

    async def wait_ready(self, shard: Shard) -> Readiness:
        """Probe a starting engine until it is ready, it ends, or ``shard.deadline`` passes.

        Sets ``shard.last_probe`` to what the last probe saw (it goes into the
        failure reason of a start that timed out).
        """
        ...

    def health_checked(self, shard: Shard) -> bool:
        """Whether a Ready shard's engine is checked by ``check`` (an engine with nothing to check is not)."""
        ...

    async def check(self, shard: Shard, before: liveness.Progress | None) -> liveness.Check:
        """One liveness check of a Ready engine (the judgement over many is the supervisor's)."""
        ...

    async def stop(self, shard: Shard, exited: ExitReport) -> None:
        """End the engine: ask it to stop now, kill it at ``shard.kill_at`` (which may move closer).

        Returns once its leader is gone (``shard.exited``).
        """
        ...

    async def reap(self, shard: Shard) -> None:
        """After the leader's exit: make sure nothing of the engine is left holding its GPUs."""
        ...

    def tail(self, shard: Shard) -> str:
        """The engine's last output of this life (unredacted: the supervisor removes the key)."""
        ...

    async def close(self) -> None:
        """Release what the driver holds for probing (the agent is exiting; engines keep running)."""
        ...
