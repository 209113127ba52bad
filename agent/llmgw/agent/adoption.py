"""What an agent does before it tells anyone what this node has.

On start the agent reconciles three sources of truth about its engines: the
records in the state dir, the processes those records name, and every
process on the node that looks like an engine.

* A record whose process is still the one it describes (pid, start time and
  boot id all match) is **adopted**: the engine keeps serving, untouched.
* A record whose process is gone, or whose pid now belongs to a different
  process (start time or boot id differ), is **removed**.  Its pid is never
  signalled: after a reuse it names a stranger.
* An engine process that no record describes is **killed**, and the agent
  waits for it to be gone before it registers.  Nothing could describe it to
  the control plane, so its GPUs would be advertised free and handed out
  again while it still holds them.

The rule for "looks like an engine of this node" (``engine_evidence``):

1. its environment carries ``LLMGW_SHARD_ID`` (set by this package's
   supervisor on every engine and inherited by its workers) and its
   ``LLMGW_NODE_ID`` is this node's id or absent; or
2. its command line starts with an engine command this node runs: the
   commands configured under ``engines`` in agent.yaml plus each adapter's
   default binary (``vllm``, ``python -m sglang.launch_server``,
   ``llama-server``); an interpreter in front (a console script's shebang)
   is looked through.

An engine that survives SIGKILL (stuck in uninterruptible sleep, typically
on a wedged GPU driver) still holds its GPUs: ``withhold_gpus`` takes them
out of what the node advertises, with a reason naming the pid, for as long
as it lives.  Which GPUs it holds is read from its ``CUDA_VISIBLE_DEVICES``
(what this package's adapters set); without one, or with one that names
devices we cannot map, it could be using any of them, so all are withheld.

A GPU can also be held by a process that is no engine at all: another
user's job, a notebook, a stuck CUDA process started under any command
line.  Nothing above finds those, but NVML lists them on the GPU
(``GPU.processes``).  ``withhold_foreign_gpus`` leaves out every GPU with a
process that is not one of this agent's engines (``OwnEngines``: an engine
leader it runs or adopted, any process in such a leader's session or
process group, since engines spawn workers, or one carrying such a shard's
``LLMGW_SHARD_ID``), naming GPU, pid and command name in ``gpu_reason``.
Such processes are never signalled: they are not ours.  The GPU comes back
at the first discovery that no longer lists them.  A pid absent from our
pid namespace is not counted: on a host every process is visible, so it
has just exited; inside a container NVML reports host pids, and counting
them would withhold the GPUs of this agent's own engines (the agent logs
them instead, ``invisible_holders``).

Never touched: this process and its ancestors; processes whose
``LLMGW_NODE_ID`` names another node (agents of a simulated fleet sharing
one host each own their engines); processes of adopted engines (same process
group, or the adopted shard's id in their environment); processes whose
environment cannot be read (another user's: we could not signal them either).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from llmgw.agent import procident
from llmgw.agent.procident import ProcessIdentity
from llmgw.agent.schema import definition_problems
from llmgw.agent.statedir import ShardRecord, StateDir
from llmgw.agent.supervisor import ENV_NODE_ID, ENV_SHARD_ID
from llmgw.hardware.advertise import Hold, advertise
from llmgw.hardware.types import HardwareInventory
from llmgw.protocol import ShardState

log = logging.getLogger(__name__)

_INTERPRETERS = ("python", "python3", "sh", "bash", "env")
# A record is written once its engine is launched, so it says one of these.
ADOPTABLE_STATES = (ShardState.STARTING.value, ShardState.READY.value, ShardState.DRAINING.value)


@dataclass(frozen=True)
class RecordVerdict:
    record: ShardRecord
    adopt: bool
    why: str


@dataclass(frozen=True)
class UnknownEngine:
    identity: ProcessIdentity
    pgid: int
    why: str
    cmdline: tuple[str, ...] = ()
    # CUDA_VISIBLE_DEVICES as it was in its environment, None when unset
    # (then the process sees every GPU of the node).
    visible_devices: str | None = None


@dataclass
class RecoveryResult:
    adopted: list[ShardRecord] = field(default_factory=list)
    removed: list[tuple[str, str]] = field(default_factory=list)  # (record, why)
    killed: list[UnknownEngine] = field(default_factory=list)
    survivors: list[UnknownEngine] = field(default_factory=list)  # could not be killed


def judge_record(record: ShardRecord) -> RecordVerdict:
    """Adopt iff the recorded process is, right now, the same running process."""
    problems = definition_problems("shard_spec", record.spec)
    if problems:
        # Reporting it would get the register refused; not reporting it would
        # leave its engine undescribed.  Dropping the record makes the engine
        # an unknown one, which the scan then kills.
        return RecordVerdict(record, False, f"its spec is not a valid shard spec ({'; '.join(problems)[:300]})")
    ident = record.process
    if ident is None:
        return RecordVerdict(record, False, "no engine was launched for it (the start did not get that far)")
    if record.state not in ADOPTABLE_STATES:
        return RecordVerdict(record, False, f"recorded state {record.state!r} is not one a running engine has")
    if ident.boot_id != procident.boot_id():
        return RecordVerdict(record, False, f"recorded under boot {ident.boot_id}; the node rebooted since")
    st = procident.read_stat(ident.pid)
    if st is None:
        return RecordVerdict(record, False, f"engine pid {ident.pid} is gone")
    if st.start_time != ident.start_time:
        return RecordVerdict(record, False, f"pid {ident.pid} now belongs to another process (start time "
                                            f"{st.start_time}, recorded {ident.start_time}); not signalled")
    if st.state in ("Z", "X"):
        return RecordVerdict(record, False, f"engine pid {ident.pid} has exited")
    return RecordVerdict(record, True, f"engine pid {ident.pid} is still running")


def _element_matches(want: str, have: str, first: bool) -> bool:
    if want == have:
        return True
    if not first or "/" in want:
        return False
    # A bare command name ("vllm") matches whatever path it was run by, and a
    # bare "python" any Python interpreter (python3, python3.11).
    have_base = os.path.basename(have)
    if want.startswith("python"):
        return have_base.startswith("python")
    return have_base == want


def command_matches(cmdline: Sequence[str], command: Sequence[str]) -> bool:
    """Does ``cmdline`` run ``command`` (possibly behind an interpreter)?"""
    if not command or not cmdline:
        return False
    starts = [0]
    base = os.path.basename(cmdline[0])
    if base.startswith(_INTERPRETERS) and len(cmdline) > 1:
        starts.append(1)
    for s in starts:
        window = cmdline[s : s + len(command)]
        if len(window) == len(command) and all(
            _element_matches(w, h, i == 0) for i, (w, h) in enumerate(zip(command, window))
        ):
            return True
    return False


def engine_commands(configured: Mapping[str, Sequence[str]]) -> list[tuple[str, ...]]:
    """Command prefixes this node's engines run as: configured ones plus the adapters' defaults."""
    from llmgw.engines import ENGINES

    out = [tuple(c) for c in configured.values() if c]
    out += [tuple(a.default_command) for a in ENGINES.values() if a.default_command]
    # A bare interpreter alone ("python") would match every Python process.
    return [c for c in dict.fromkeys(out) if not (len(c) == 1 and os.path.basename(c[0]).startswith(_INTERPRETERS))]


def engine_evidence(environ: Mapping[str, str], cmdline: Sequence[str], node_id: str,
                    commands: Iterable[Sequence[str]]) -> str | None:
    """Why this process is an engine belonging to this node, or None (pure)."""
    owner = environ.get(ENV_NODE_ID)
    if owner is not None and owner != node_id:
        return None  # another agent's engine on a shared host
    shard = environ.get(ENV_SHARD_ID)
    if shard:
        return f"launched for shard {shard} ({ENV_SHARD_ID} set) but no record describes it"
    for cmd in commands:
        if command_matches(cmdline, cmd):
            return f"runs engine command {' '.join(cmd)!r} but no record describes it"
    return None


def find_unknown_engines(node_id: str, commands: Sequence[Sequence[str]],
                         adopted: Sequence[ShardRecord]) -> list[UnknownEngine]:
    """Every process that looks like this node's engine and that no adopted record covers.

    A process caught inside execve has its new name already but, for a moment,
    an empty command line and environment: it is looked at again once, shortly
    after, rather than passed over as a kernel thread.
    """
    protected = procident.ancestors()
    adopted_groups = {r.process.pid for r in adopted if r.process}
    adopted_ids = {r.shard_id for r in adopted}
    my_uid = os.getuid()
    found: list[UnknownEngine] = []

    def examine(pid: int) -> bool:
        """Add ``pid`` to ``found`` if it is an unknown engine; True when it could not be read yet."""
        if pid in protected:
            return False
        st = procident.read_stat(pid)
        if st is None or st.state in ("Z", "X") or st.pgid in adopted_groups:
            return False
        try:
            if my_uid != 0 and os.stat(f"/proc/{pid}").st_uid != my_uid:
                return False
        except OSError:
            return False
        env = procident.read_environ(pid)
        cmdline = procident.read_cmdline(pid)
        if env is None or not cmdline:
            return env is not None or cmdline is not None
        if env.get(ENV_SHARD_ID) in adopted_ids and env.get(ENV_NODE_ID, node_id) == node_id:
            return False
        why = engine_evidence(env, cmdline, node_id, commands)
        if why is None:
            return False
        ident = procident.identify(pid)
        if ident is not None and ident.start_time == st.start_time:
            found.append(UnknownEngine(ident, st.pgid, why, tuple(cmdline), env.get("CUDA_VISIBLE_DEVICES")))
        return False

    racing = [pid for pid in procident.list_pids() if examine(pid)]
    if racing:
        time.sleep(0.05)
        for pid in racing:
            examine(pid)
    return found


def _signal_unknown(engine: UnknownEngine, sig: int) -> None:
    if not procident.is_same_process(engine.identity):
        return
    try:
        # The group only when the engine leads it (as our supervisor's engines
        # do) and it is not ours: never signal a group we are part of.
        if engine.pgid == engine.identity.pid and engine.pgid != os.getpgrp():
            os.killpg(engine.pgid, sig)
        else:
            os.kill(engine.identity.pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError as e:
        log.error("cannot signal unidentified engine pid %d: %s", engine.identity.pid, e)


async def kill_engines(engines: Sequence[UnknownEngine], grace: float = 5.0,
                       poll: float = 0.1, kill_wait: float = 30.0) -> list[UnknownEngine]:
    """SIGTERM, wait ``grace``, SIGKILL, wait; return the ones that still live."""
    if not engines:
        return []
    for e in engines:
        log.warning("killing unidentified engine pid %d: %s; cmdline: %s",
                    e.identity.pid, e.why, " ".join(e.cmdline)[:500])
        _signal_unknown(e, signal.SIGTERM)

    def alive() -> list[UnknownEngine]:
        return [e for e in engines if procident.is_running(e.identity)]

    loop = asyncio.get_running_loop()
    end = loop.time() + grace
    while alive() and loop.time() < end:
        await asyncio.sleep(poll)
    left = alive()
    for e in left:
        log.warning("unidentified engine pid %d survived SIGTERM for %gs; sending SIGKILL", e.identity.pid, grace)
        _signal_unknown(e, signal.SIGKILL)
    end = loop.time() + kill_wait
    while alive() and loop.time() < end:
        await asyncio.sleep(poll)
    return alive()


async def recover(statedir: StateDir, node_id: str, configured_commands: Mapping[str, Sequence[str]],
                  *, kill_grace: float = 5.0, kill_wait: float = 30.0) -> RecoveryResult:
    """Judge every record, remove the dead, kill the unknown; return what to adopt.

    Must complete before the first ``register``: that message advertises the
    node's GPUs, and a GPU an unknown engine still holds is not free.
    """
    result = RecoveryResult()
    records, unreadable = statedir.load()
    for bad in unreadable:
        log.warning("state dir: removing %s: %s", bad.path, bad.reason)
        statedir.remove_path(bad.path)
        result.removed.append((str(bad.path), bad.reason))
    for rec in records:
        verdict = judge_record(rec)
        if verdict.adopt:
            result.adopted.append(rec)
        else:
            log.info("shard %s: removing its record: %s", rec.shard_id, verdict.why)
            statedir.log_note(rec.shard_id, f"agent restarted; record removed: {verdict.why}")
            statedir.remove(rec.shard_id)
            result.removed.append((rec.shard_id, verdict.why))
    unknown = find_unknown_engines(node_id, engine_commands(configured_commands), result.adopted)
    result.survivors = await kill_engines(unknown, grace=kill_grace, kill_wait=kill_wait)
    result.killed = [e for e in unknown if e not in result.survivors]
    for e in result.survivors:
        log.error("unidentified engine pid %d survives SIGKILL (state %s); GPUs it can see (CUDA_VISIBLE_DEVICES=%s) "
                  "are withheld from the control plane while it lives", e.identity.pid,
                  getattr(procident.read_stat(e.identity.pid), "state", "?"),
                  "unset: all" if e.visible_devices is None else repr(e.visible_devices))
    return result


def held_gpu_indices(visible_devices: str | None, inventory: HardwareInventory) -> set[int]:
    """The node's GPU indices a process with this ``CUDA_VISIBLE_DEVICES`` can be using.

    Unset: all of them.  Each entry is an index or a (prefix of a) GPU UUID,
    as CUDA accepts; one that maps to no GPU of the inventory (a MIG
    instance, a typo) makes the answer "all", since guessing low here hands
    out a GPU that is in use.  An empty value hides every GPU.
    """
    every = {g.index for g in inventory.gpus}
    if visible_devices is None:
        return every
    held: set[int] = set()
    for token in (t.strip() for t in visible_devices.split(",")):
        if not token:
            continue
        if token.lstrip("-").isdigit():
            idx = int(token)
            if idx < 0:  # CUDA stops at a negative index: nothing after it is visible
                break
            if idx not in every:
                return every
            held.add(idx)
            continue
        matches = [g.index for g in inventory.gpus if g.uuid.startswith(token)]
        if len(matches) != 1:
            return every
        held.add(matches[0])
    return held


def survivor_holds(inventory: HardwareInventory, survivors: Sequence[UnknownEngine]) -> list[Hold]:
    """The GPUs ``survivors`` (engines we failed to kill) hold, one ``Hold`` per pid.

    The register message has nowhere to mark a GPU busy-but-not-ours, so a
    withheld GPU is left out of ``gpus`` (NVLink peers pointing at it too)
    and ``gpu_reason`` says which, held by which pid: the control plane
    cannot place on it, and an operator reading the node sees why.
    """
    held: dict[int, list[int]] = {}
    for e in survivors:
        for idx in held_gpu_indices(e.visible_devices, inventory):
            held.setdefault(idx, []).append(e.identity.pid)
    by_pid: dict[int, list[int]] = {}
    for idx, pids in sorted(held.items()):
        for pid in pids:
            by_pid.setdefault(pid, []).append(idx)
    return [Hold(tuple(idxs), f"GPU(s) {', '.join(map(str, idxs))} withheld: held by pid {pid}, an unidentified "
                 f"engine that survived SIGKILL") for pid, idxs in by_pid.items()]


def withhold_gpus(inventory: HardwareInventory, survivors: Sequence[UnknownEngine]) -> HardwareInventory:
    """``inventory`` without the GPUs that ``survivors`` hold (see ``survivor_holds``)."""
    if not survivors:
        return inventory
    return advertise(inventory, held=lambda inv: survivor_holds(inv, survivors)).inventory


# --- GPUs held by processes that are not this agent's engines ----------------


@dataclass(frozen=True)
class OwnEngines:
    """What makes a process one of this agent's engines (see the module docstring)."""

    node_id: str
    leaders: frozenset[int] = frozenset()  # pids of engine leaders it runs or adopted
    shard_ids: frozenset[str] = frozenset()  # their shards, as in each worker's LLMGW_SHARD_ID

    @classmethod
    def of(cls, node_id: str, engines: Iterable[tuple[str, ProcessIdentity | None]]) -> "OwnEngines":
        """From (shard id, leader identity) pairs; a leader no longer that process counts for nothing.

        A leader that has exited but not been reaped still counts: its pid
        cannot have been reused, and its workers may still run.
        """
        leaders: set[int] = set()
        shards: set[str] = set()
        for shard_id, ident in engines:
            shards.add(shard_id)
            if ident is not None and procident.is_same_process(ident):
                leaders.add(ident.pid)
        return cls(node_id, frozenset(leaders), frozenset(shards))

    def owns(self, pid: int) -> bool:
        """Is ``pid`` (as seen in our namespace) an engine of ours or one of its workers?"""
        if pid in self.leaders:
            return True
        st = procident.read_stat(pid)
        if st is None:
            return False
        # The kernel never hands out a pid that is still some process's
        # session or group id, so a match here is the leader's own session.
        if st.sid in self.leaders or st.pgid in self.leaders:
            return True
        if not self.shard_ids:
            return False
        env = procident.read_environ(pid)
        if not env:
            return False
        return env.get(ENV_SHARD_ID) in self.shard_ids and env.get(ENV_NODE_ID, self.node_id) == self.node_id


@dataclass(frozen=True)
class ForeignHolder:
    """A process NVML lists on a GPU that is not one of this agent's engines."""

    gpu: int
    pid: int
    comm: str | None  # command name from /proc/<pid>/stat; None when the pid is not in our namespace
    used_memory_bytes: int | None = None

    def describe(self) -> str:
        if self.comm is None:
            return f"pid {self.pid} (no such process in the agent's pid namespace)"
        return f"pid {self.pid} ({self.comm})"


def foreign_holders(inventory: HardwareInventory, own: OwnEngines) -> list[ForeignHolder]:
    """Every (GPU, process) pair where NVML lists a process that ``own`` does not cover.

    A GPU whose ``processes`` are unknown (None) yields nothing: there is
    nothing to go on, and withholding every GPU whenever NVML cannot list
    processes would take a whole node down for a missing driver feature.
    """
    out: list[ForeignHolder] = []
    for g in inventory.gpus:
        for p in g.processes or ():
            if own.owns(p.pid):
                continue
            st = procident.read_stat(p.pid)
            if st is not None:
                out.append(ForeignHolder(g.index, p.pid, st.comm, p.used_memory_bytes))
    return out


def invisible_holders(inventory: HardwareInventory) -> list[ForeignHolder]:
    """(GPU, pid) pairs NVML lists whose pid does not exist in our pid namespace.

    Not withheld (see the module docstring): reported so an agent in a
    container without the host's pid namespace says it cannot see who
    holds its GPUs.
    """
    return [ForeignHolder(g.index, p.pid, None, p.used_memory_bytes)
            for g in inventory.gpus for p in g.processes or () if procident.read_stat(p.pid) is None]


def withhold_foreign_gpus(inventory: HardwareInventory, own: OwnEngines
                          ) -> tuple[HardwareInventory, list[ForeignHolder]]:
    """``inventory`` without GPUs held by processes that are not ours, and those holders.

    Nothing is ever signalled.  The reason, per GPU: ``GPU 3 withheld: in use
    by pid 4242 (python3), not an llmgw engine``.
    """
    out = advertise(inventory, foreign=lambda inv: foreign_holders(inv, own))
    return out.inventory, list(out.holders)  # type: ignore[arg-type]
