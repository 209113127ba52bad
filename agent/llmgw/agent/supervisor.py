"""Launch, watch, probe and stop engines; report every transition.

One ``Shard`` per shard id, driven by tasks on the agent's single event loop:

* a *lifecycle* task takes a start from ``pending`` to ``starting`` (checks,
  port, launch, record) and then waits for readiness until the start
  deadline;
* a *watch* task notices the engine's exit and is the only place that
  reports the terminal state of a launched shard, so a timeout, a stop and a
  crash can never produce two conflicting reports.

Engines run in their own session (``start_new_session=True``), so the agent
dying, being restarted by systemd, or losing its terminal never takes them
down, and so a stop can signal the whole process group (vLLM's workers
included).  An engine this process launched is watched through a pidfd; one
adopted from a previous agent is not our child and cannot be waited on, so
it is watched by polling its identity.  Either way it is stopped the same
way: SIGTERM to the group, SIGKILL after a grace, and never a signal unless
the recorded pid still has the recorded start time and boot id.

``subprocess.Popen`` is used rather than asyncio's subprocess transport on
purpose: the transport kills its child when it is closed or garbage
collected, and an agent that exits must leave its engines running.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp

from llmgw import compat
from llmgw.agent import liveness, procident
from llmgw.agent.ports import choose_port
from llmgw.agent.probe import EngineTLSClient, base_url, completion_probe, get_text, is_loopback, probe_host
from llmgw.agent.procident import ProcessIdentity
from llmgw.agent.shardstate import ShardState, check_transition, exit_outcome
from llmgw.agent.statedir import ShardRecord, StateDir
from llmgw.catalog import Model, Profile, SourceKind, source_kind
from llmgw.settings import EngineTLS, FetchPolicy
from llmgw.tls.files import write_atomic

log = logging.getLogger(__name__)

Emit = Callable[[dict[str, Any]], None]

# Environment markers on every engine this agent launches.  They are how a
# later agent recognises an engine of this node that no record describes
# (see adoption.py), and how a straggler of a dead engine's group is told
# apart from an unrelated process.
ENV_NODE_ID = "LLMGW_NODE_ID"
ENV_SHARD_ID = "LLMGW_SHARD_ID"
ENV_REPLICA_ID = "LLMGW_REPLICA_ID"

URL_SOURCE_UNAVAILABLE = "https sources are fetched before launch by the weights fetcher (not available in this build)"

MAX_REASON = 4096
MAX_TAIL = 65536


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
    popen: subprocess.Popen[bytes] | None = None
    port: int | None = None
    master_port: int | None = None
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
    )


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "exited (exit status unknown: adopted engines are not this agent's children)"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with status {returncode}"


def group_members(pgid: int, shard_id: str, node_id: str) -> list[ProcessIdentity]:
    """Live processes in group ``pgid`` that carry this shard's markers.

    Used once the group leader is gone (a dead engine's workers still holding
    GPUs): with the leader's identity unverifiable, a process is signalled
    only if it is in that group *and* was launched for this very shard.
    """
    out = []
    for pid in procident.list_pids():
        st = procident.read_stat(pid)
        if st is None or st.pgid != pgid or st.state in ("Z", "X"):
            continue
        env = procident.read_environ(pid) or {}
        if env.get(ENV_SHARD_ID) == shard_id and env.get(ENV_NODE_ID, node_id) == node_id:
            ident = procident.identify(pid)
            if ident is not None:
                out.append(ident)
    return out


def signal_verified(identity: ProcessIdentity, sig: int, *, group: bool) -> bool:
    """Send ``sig`` to ``identity`` (its whole group when it leads one) iff it is still that process.

    Returns whether anything was signalled.  A pid whose start time or boot id
    differs from the identity is never signalled: it is someone else now.
    """
    if not procident.is_same_process(identity):
        return False
    st = procident.read_stat(identity.pid)
    try:
        if group and st is not None and st.pgid == identity.pid and identity.pid != os.getpgrp():
            os.killpg(identity.pid, sig)
        else:
            os.kill(identity.pid, sig)
    except ProcessLookupError:
        return False
    except PermissionError as e:
        log.error("cannot signal pid %d: %s", identity.pid, e)
        return False
    return True


class Supervisor:
    """Every shard on this node.  ``emit`` receives each ``shard_status`` message."""

    def __init__(self, config: SupervisorConfig, statedir: StateDir, emit: Emit):
        self.config = config
        self.statedir = statedir
        self.emit = emit
        self.shards: dict[str, Shard] = {}
        self._session: aiohttp.ClientSession | None = None
        self._tls_client: EngineTLSClient | None = None

    # ------------------------------------------------------------------ reports
    def live_shards(self) -> list[Shard]:
        return [s for s in self.shards.values() if not s.state.terminal]

    def report(self, shard: Shard) -> dict[str, Any]:
        """The ``shard_report`` for ``register``."""
        r: dict[str, Any] = {"spec": shard.spec, "state": shard.state.value, "adopted": shard.adopted,
                             "started_at": shard.started_at}
        if shard.identity is not None:
            r["process"] = shard.identity.to_dict()
            r["port"] = shard.port
            r["address"] = self.config.advertise_address
            if shard.tls:  # only when https: a control plane older than engine TLS knows no scheme
                r["scheme"] = shard.scheme
        return r

    def reports(self) -> list[dict[str, Any]]:
        return [self.report(s) for s in self.live_shards()]

    def status_message(self, shard: Shard, reason: str | None = None,
                       output_tail: str | None = None) -> dict[str, Any]:
        msg: dict[str, Any] = {"type": "shard_status", "shard_id": shard.shard_id,
                               "replica_id": shard.spec["replica_id"], "state": shard.state.value}
        if shard.spec.get("grant") is not None:
            msg["grant"] = shard.spec["grant"]  # the control plane's word for this shard, presented back
        if shard.identity is not None:
            msg["process"] = shard.identity.to_dict()
            msg["port"] = shard.port
            msg["master_port"] = shard.master_port
            msg["address"] = self.config.advertise_address
            if shard.tls:
                msg["scheme"] = shard.scheme
        if reason:
            msg["reason"] = reason[:MAX_REASON]
        if output_tail is not None:
            msg["output_tail"] = output_tail[-MAX_TAIL:]
        return msg

    def gpus_held(self, exclude: str | None = None) -> dict[int, str]:
        """GPU index -> the live shard holding it (``exclude``: a shard asking about the others)."""
        held: dict[int, str] = {}
        for s in self.live_shards():
            if s.shard_id == exclude:
                continue
            for g in s.spec.get("gpu_indices", ()):
                held[int(g)] = s.shard_id
        return held

    def _ports_held(self) -> set[int]:
        return {p for s in self.live_shards() for p in (s.port, s.master_port) if p}

    # -------------------------------------------------------------- transitions
    def _transition(self, shard: Shard, new: ShardState, reason: str | None = None,
                    output_tail: str | None = None) -> None:
        check_transition(shard.state, new)
        old, shard.state = shard.state, new
        if new.terminal:
            self.statedir.remove(shard.shard_id)
            self.statedir.remove_secrets(shard.shard_id)
        elif shard.launched:
            self._persist(shard)
        log_fn = log.warning if new is ShardState.FAILED else log.info
        log_fn("shard %s: %s -> %s%s", shard.shard_id, old.value, new.value, f" ({reason})" if reason else "")
        self.emit(self.status_message(shard, reason, output_tail))
        if new is ShardState.READY:
            self._watch_liveness(shard)

    def _persist(self, shard: Shard) -> None:
        self.statedir.write(ShardRecord(
            spec=shard.spec, state=shard.state.value, process=shard.identity, port=shard.port,
            master_port=shard.master_port, address=self.config.advertise_address,
            started_at=shard.started_at,
            start_deadline=shard.deadline if shard.state is ShardState.STARTING else None,
            argv=shard.argv, extra={"launch_marker": shard.launch_marker, "log_offset": shard.log_offset,
                                    "tls": shard.tls}))

    def _fail_before_launch(self, shard: Shard, reason: str) -> None:
        self._transition(shard, ShardState.FAILED, reason, output_tail="")

    def _tail(self, shard: Shard) -> str:
        tail = self.statedir.log_tail(shard.shard_id, self.config.tail_bytes, since_offset=shard.log_offset,
                                      since_marker=None if shard.log_offset is not None else shard.launch_marker or None)
        # Some engines print their arguments at startup (SGLang's server_args); the
        # tail travels to the control plane and operators, the key must not.
        key = shard.spec.get("api_key")
        return tail.replace(key, "<engine key>") if key else tail

    # -------------------------------------------------------------------- start
    def start(self, spec: dict[str, Any]) -> Shard:
        """Accept a ``start``.  A start for a shard that is already live re-reports it.

        The control plane may resend a start it is not sure arrived; launching
        a second engine for the same shard would hold its GPUs twice.
        """
        shard_id = str(spec["shard_id"])
        cur = self.shards.get(shard_id)
        if cur is not None and not cur.state.terminal:
            log.info("shard %s: start received while %s; reporting current state", shard_id, cur.state.value)
            self.emit(self.status_message(cur))
            return cur
        timeout = float(spec["profile"]["start_timeout"])
        shard = Shard(spec=spec, state=ShardState.PENDING, started_at=time.time(),
                      deadline=time.monotonic() + timeout)
        self.shards[shard_id] = shard
        self.emit(self.status_message(shard))
        shard.lifecycle = asyncio.get_running_loop().create_task(self._run_start(shard), name=f"start {shard_id}")
        return shard

    async def _run_start(self, shard: Shard) -> None:
        try:
            if not await self._launch(shard):
                return
            await self._await_ready(shard)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug must surface as a failed shard, not a silent hang
            log.exception("shard %s: start failed unexpectedly", shard.shard_id)
            if shard.launched:
                self._end(shard, ShardState.FAILED, f"agent error while starting: {type(e).__name__}: {e}",
                          self.config.stop_grace)
            elif not shard.state.terminal:
                self._fail_before_launch(shard, f"agent error while starting: {type(e).__name__}: {e}")

    def _preflight(self, shard: Shard, model: Model, profile: Profile) -> str | None:
        """Why this shard cannot be launched here, or None.  Checks that need no I/O first."""
        from llmgw.engines import ProfileError, validate

        try:
            validate(model, profile)
        except ProfileError as e:
            return str(e)
        if (shard.rank == 0 and not shard.spec.get("api_key") and not self.config.allow_keyless_engines
                and not is_loopback(self.config.engine_bind_host)):
            return (f"no engine key in the start for {shard.shard_id}: an engine bound to "
                    f"{self.config.engine_bind_host} without one serves anyone who can reach the node; "
                    "upgrade the control plane, bind engines to loopback, or set allow_keyless_engines")
        held = self.gpus_held(exclude=shard.shard_id)
        clash = sorted(int(g) for g in shard.spec.get("gpu_indices", ()) if int(g) in held)
        if clash:
            owners = sorted({held[g] for g in clash})
            return f"GPU(s) {clash} are held by shard(s) {', '.join(owners)} on this node"
        return None

    def _checked(self, shard: Shard) -> tuple[Model, Profile] | None:
        """The shard's model and profile, or None after failing the shard for a preflight problem."""
        model, profile = spec_model(shard.spec), spec_profile(shard.spec)
        problem = self._preflight(shard, model, profile)
        if problem:
            self._fail_before_launch(shard, problem)
            return None
        return model, profile

    async def _resolve_source(self, shard: Shard, model: Model) -> str | None:
        """The model path to hand the engine, or None after failing the shard."""
        from llmgw.engines import SourceError, resolve_model_path

        kind = source_kind(model.source)
        if kind is SourceKind.URL:
            try:
                from llmgw.agent import fetch
            except ImportError:
                self._fail_before_launch(shard, URL_SOURCE_UNAVAILABLE)
                return None
            # The weights fetcher's contract: download (single-flight, resumable,
            # verified) into model_dir, emit ``progress`` messages through
            # ``progress``, return the local path, raise with a reason on failure.
            self._transition(shard, ShardState.FETCHING)
            # The start deadline covers the download too: progress never
            # extends it, so a download that cannot finish in time fails the
            # start instead of keeping a doomed replica alive.
            remaining = max(0.0, shard.deadline - time.monotonic())
            try:
                return await compat.wait_for(
                    fetch.fetch_weights(model, self.config.model_dir, progress=self.emit, shard_id=shard.shard_id,
                                        node_id=self.config.node_id, policy=self.config.fetch),
                    timeout=remaining)
            except (TimeoutError, asyncio.TimeoutError):
                timeout = float(shard.spec["profile"]["start_timeout"])
                self._fail_before_launch(shard, f"not ready within start_timeout ({timeout:g}s): still fetching "
                                                f"{model.source}")
                return None
            except Exception as e:
                self._fail_before_launch(shard, f"fetching {model.source}: {e}")
                return None
        if kind in (SourceKind.REPO, SourceKind.HF):
            return await self._fetch_repository(shard, model)
        try:
            return resolve_model_path(model, self.config.model_dir)
        except SourceError as e:
            self._fail_before_launch(shard, str(e))
            return None

    async def _fetch_repository(self, shard: Shard, model: Model) -> str | None:
        """A repository's local directory (a mirror with a manifest, or hf://); None after failing the shard.

        Unlike a single file, a repository (tens of shards, hundreds of GiB) is
        fetched outside ``start_timeout``: the fetcher's own stall and attempt
        limits end a fetch that cannot finish, and the start clock begins when
        the engine is launched on the complete directory.
        """
        from llmgw.agent import fetch

        self._transition(shard, ShardState.FETCHING)
        try:
            path = await fetch.fetch_repository(model, self.config.model_dir, progress=self.emit,
                                                shard_id=shard.shard_id, node_id=self.config.node_id,
                                                policy=self.config.fetch)
        except Exception as e:
            self._fail_before_launch(shard, f"fetching {model.source}: {e}")
            return None
        shard.deadline = time.monotonic() + float(shard.spec["profile"]["start_timeout"])
        return path

    @staticmethod
    def _offline_env(model: Model) -> dict[str, str]:
        """An engine on a fetched repository loads it as it is: no hub behind the agent's back."""
        if model.kind not in (SourceKind.REPO, SourceKind.HF):
            return {}
        from llmgw.agent.fetch import OFFLINE_ENV

        return dict(OFFLINE_ENV)

    async def _launch(self, shard: Shard) -> bool:
        from llmgw.engines import LaunchContext, LaunchContextError, ProfileError, build_launch

        spec = shard.spec
        checked = self._checked(shard)
        if checked is None:
            return False
        model, profile = checked
        model_path = await self._resolve_source(shard, model)
        if model_path is None or shard.state.terminal:
            return False
        if time.monotonic() >= shard.deadline:
            self._fail_before_launch(shard, f"start_timeout of {profile.start_timeout:g}s passed before launch")
            return False

        rank, nnodes = int(spec["rank"]), int(spec["nnodes"])
        first, last = self.config.engine_ports
        taken = self._ports_held()
        port = 0
        if rank == 0:
            chosen = choose_port(first, last, self.config.engine_bind_host, taken)
            if chosen is None:
                self._fail_before_launch(shard, f"no free engine port in {first}-{last}")
                return False
            port = chosen
            taken.add(port)
        master_addr, master_port = spec.get("master_addr"), spec.get("master_port")
        if nnodes > 1 and rank == 0:
            master_addr = master_addr or self.config.advertise_address
            if master_port is None:
                master_port = choose_port(first, last, self.config.engine_bind_host, taken)
                if master_port is None:
                    self._fail_before_launch(shard, f"no free rendezvous port in {first}-{last}")
                    return False
        try:
            launch = build_launch(model, profile, LaunchContext(
                host=self.config.engine_bind_host, port=port, model_path=model_path, rank=rank,
                nnodes=nnodes, master_addr=master_addr, master_port=master_port,
                gpu_indices=tuple(int(g) for g in spec.get("gpu_indices", ())),
                extra_env=dict(spec.get("env", {})),
                command=self.config.engine_commands.get(profile.engine),
                api_key=spec.get("api_key") or None,
                secret_dir=str(self.statedir.secret_dir(shard.shard_id)),
                **self._tls_files(profile)))
        except (ProfileError, LaunchContextError) as e:
            self._fail_before_launch(shard, str(e))
            return False

        for f in launch.files:
            write_atomic(f.path, f.data.encode(), mode=0o600)
        env = {**os.environ, **launch.env, **self._offline_env(model), ENV_NODE_ID: self.config.node_id,
               ENV_SHARD_ID: shard.shard_id, ENV_REPLICA_ID: str(spec["replica_id"])}
        shard.launch_marker = f"launch {secrets.token_hex(8)}"
        log_fd = self.statedir.open_log(shard.shard_id)
        shard.log_offset = os.fstat(log_fd).st_size
        self.statedir.log_note(shard.shard_id, f"{shard.launch_marker} of shard {shard.shard_id} at "
                               f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} (engine log from byte {shard.log_offset}): "
                               f"{' '.join(launch.argv)}")
        try:
            popen = subprocess.Popen(list(launch.argv), env=env, stdin=subprocess.DEVNULL, stdout=log_fd,
                                     stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
                                     cwd=str(self.statedir.root))
        except OSError as e:
            self._fail_before_launch(shard, f"cannot launch {launch.argv[0]!r}: {e}")
            return False
        finally:
            os.close(log_fd)
        identity = procident.identify(popen.pid)
        if identity is None:  # exited and was reaped already? Popen has not waited, so it is a zombie at worst
            identity = ProcessIdentity(popen.pid, 0, procident.boot_id())
        shard.popen, shard.identity, shard.argv = popen, identity, tuple(launch.argv)
        shard.port = launch.port if launch.serves_http else None
        shard.tls = launch.tls
        shard.master_port = master_port if rank == 0 and nnodes > 1 else None
        self._transition(shard, ShardState.STARTING)  # persists the record with pid + start time
        shard.watcher = asyncio.get_running_loop().create_task(self._watch_child(shard),
                                                               name=f"watch {shard.shard_id}")
        return True

    # ---------------------------------------------------------------- readiness
    async def _await_ready(self, shard: Shard) -> None:
        """Probe until ready, the engine exits, or the start deadline passes.

        The deadline was fixed when the start was accepted (and survives an
        agent restart through the record); nothing observed while waiting,
        download progress included, ever moves it.
        """
        served = str(shard.spec["model"]["served_name"])
        url = self._engine_url(shard) if shard.port else ""
        while shard.state is ShardState.STARTING and shard.end_intent is None:
            remaining = shard.deadline - time.monotonic()
            if remaining <= 0:
                timeout = float(shard.spec["profile"]["start_timeout"])
                why = f"not ready within start_timeout ({timeout:g}s)"
                if shard.last_probe:
                    why += f"; last probe: {shard.last_probe}"
                self._end(shard, ShardState.FAILED, why, self.config.stop_grace)
                return
            if shard.port:
                res = await completion_probe(self._http(), url, served, min(self.config.probe_timeout, remaining),
                                             shard.spec.get("api_key"), self._engine_tls(shard))
                ok, shard.last_probe = res.ok, res.detail
            else:  # ranks > 0 serve no HTTP: liveness is all there is to check
                ok = shard.identity is not None and procident.is_running(shard.identity)
            if shard.exited.is_set() or shard.end_intent is not None or shard.state is not ShardState.STARTING:
                return
            if ok:
                self._transition(shard, ShardState.READY)
                return
            wait = min(self.config.probe_interval, max(0.0, shard.deadline - time.monotonic()))
            try:
                await compat.wait_for(shard.exited.wait(), timeout=wait)
            except (TimeoutError, asyncio.TimeoutError):
                pass

    # ------------------------------------------------------------------ liveness
    def _watch_liveness(self, shard: Shard) -> None:
        if shard.monitor is None or shard.monitor.done():
            shard.monitor = asyncio.get_running_loop().create_task(self._liveness(shard),
                                                                   name=f"health {shard.shard_id}")

    async def _liveness(self, shard: Shard) -> None:
        """Check a Ready shard every ``health.interval`` until it is not Ready; fail it when it stops serving.

        The judgement is ``liveness.observe``; ending the engine goes through
        ``_end`` like a start timeout, so the watch task still reports the one
        terminal state, with this reason, once the engine is gone.
        """
        policy = self.config.health
        live = liveness.Liveness(last_ok=time.monotonic())
        while True:
            try:
                await compat.wait_for(shard.exited.wait(), timeout=policy.interval)
                return
            except (TimeoutError, asyncio.TimeoutError):
                pass
            if shard.state is not ShardState.READY or shard.end_intent is not None:
                return
            check = await self._check(shard, live.progress)
            if shard.state is not ShardState.READY or shard.end_intent is not None or shard.exited.is_set():
                return
            live, reason = liveness.observe(live, check, time.monotonic(), policy)
            shard.checks += 1
            shard.checks_failed += not check.ok
            if not check.ok:
                log.warning("shard %s: health check failed (%d in a row): %s", shard.shard_id, live.failures,
                            check.detail)
            if reason is not None:
                self.statedir.log_note(shard.shard_id, f"failed by the agent's health check: {reason}")
                self._end(shard, ShardState.FAILED, reason, policy.kill_after)
                return

    async def _check(self, shard: Shard, before: liveness.Progress | None) -> liveness.Check:
        """One liveness check: the process for ranks > 0; /health, /metrics (or a completion) for rank 0."""
        assert shard.identity is not None
        if not shard.port:
            st = procident.read_stat(shard.identity.pid) if procident.is_same_process(shard.identity) else None
            return liveness.judge_process(st.state if st is not None else None)
        timeout = self.config.health.timeout
        url, tls = self._engine_url(shard), self._engine_tls(shard)
        status, body = await get_text(self._http(), f"{url}/health", timeout, "health", tls=tls)
        if status is None or status != 200:
            detail = body if status is None else f"health: HTTP {status}: {body[:300]}"
            return liveness.judge_engine(False, detail, before, None)
        engine = str(shard.spec["profile"]["engine"])
        status, body = await get_text(self._http(), f"{url}/metrics", timeout, "metrics",
                                      shard.spec.get("api_key"), tls)
        progress = (liveness.progress_from_samples(liveness.parse_samples(body), engine)
                    if status == 200 else None)
        if progress is None:  # nothing to read progress from: serving one token is the proof
            res = await completion_probe(self._http(), url, str(shard.spec["model"]["served_name"]), timeout,
                                         shard.spec.get("api_key"), tls)
            return liveness.Check(res.ok, res.detail)
        return liveness.judge_engine(True, "ok", before, progress)

    def _tls_files(self, profile: Profile) -> dict[str, str]:
        """The engine certificate for the adapter, when this node has one and gives it to this engine."""
        etls = self.config.engine_tls
        if etls is None or profile.engine not in etls.engines:
            return {}
        return {"tls_cert": etls.cert, "tls_key": etls.key}

    def _engine_url(self, shard: Shard) -> str:
        return base_url(probe_host(self.config.engine_bind_host), int(shard.port or 0), shard.scheme)

    def _engine_tls(self, shard: Shard) -> EngineTLSClient | None:
        """How to verify this shard's engine: the fleet CA and the fleet address, as a router does."""
        if not shard.tls:
            return None
        if self._tls_client is None:
            import ssl

            from llmgw.tls.context import client_context

            # No fleet CA (an adopted TLS engine after tls was removed from agent.yaml): the system's
            # CAs, which fail the check with the verification error rather than trusting anything.
            context = client_context(self.config.engine_ca) if self.config.engine_ca else ssl.create_default_context()
            self._tls_client = EngineTLSClient(context, self.config.advertise_address)
        return self._tls_client

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True))
        return self._session

    # ------------------------------------------------------------------ watching
    async def _watch_child(self, shard: Shard) -> None:
        """Wait for a child of ours to exit (pidfd, else polling), then conclude."""
        popen = shard.popen
        assert popen is not None
        loop = asyncio.get_running_loop()
        pidfd = -1
        try:
            pidfd = os.pidfd_open(popen.pid)
        except (AttributeError, OSError):
            pidfd = -1
        try:
            if pidfd >= 0:
                ready = loop.create_future()

                def _readable() -> None:
                    loop.remove_reader(pidfd)
                    if not ready.done():
                        ready.set_result(None)

                loop.add_reader(pidfd, _readable)
                try:
                    await ready
                finally:
                    loop.remove_reader(pidfd)
            while popen.poll() is None:
                await asyncio.sleep(self.config.poll_interval)
        finally:
            if pidfd >= 0:
                os.close(pidfd)
        await self._conclude(shard, describe_exit(popen.returncode))

    async def _watch_adopted(self, shard: Shard) -> None:
        """An adopted engine is not our child: poll its identity until it is gone."""
        assert shard.identity is not None
        while procident.is_running(shard.identity):
            await asyncio.sleep(self.config.poll_interval)
        await self._conclude(shard, describe_exit(None))

    async def _conclude(self, shard: Shard, exit_desc: str) -> None:
        """The leader exited: clear out its group, then report the terminal state once."""
        shard.exit_desc = exit_desc
        shard.exited.set()
        try:
            await self._settle(shard, exit_desc)
        finally:
            shard.concluded.set()

    async def _settle(self, shard: Shard, exit_desc: str) -> None:
        await self._reap_group(shard)
        if shard.state.terminal:
            return
        intent = shard.end_intent
        if shard.state is ShardState.DRAINING:
            # Asked to stop: however it ended, it ended because we asked.
            outcome, why = ShardState.STOPPED, intent[1] if intent else f"engine {exit_desc}"
        elif intent is not None:
            outcome, why = intent[0], f"{intent[1]}; engine {exit_desc}"
        else:
            phase = "during start" if shard.state in (ShardState.PENDING, ShardState.FETCHING,
                                                      ShardState.STARTING) else "while serving"
            outcome, why = exit_outcome(shard.state, stopping=False), f"engine {exit_desc} {phase}"
        if outcome is ShardState.FAILED:
            self._transition(shard, ShardState.FAILED, why, output_tail=self._tail(shard))
        else:
            if shard.state is not ShardState.DRAINING:
                self._transition(shard, ShardState.DRAINING)
            self._transition(shard, ShardState.STOPPED, why)
        self.statedir.log_note(shard.shard_id, f"engine {exit_desc}; shard {shard.state.value}")

    async def _reap_group(self, shard: Shard) -> None:
        """SIGKILL whatever is left of the engine's process group and wait until it is empty.

        A terminal state promises the control plane the shard's GPUs are free;
        a worker that outlived its leader would make that a lie.
        """
        assert shard.identity is not None
        for _ in range(int(30 / self.config.poll_interval) + 1):
            members = group_members(shard.identity.pid, shard.shard_id, self.config.node_id)
            if not members:
                return
            for m in members:
                log.warning("shard %s: killing leftover process %d of the engine's group", shard.shard_id, m.pid)
                signal_verified(m, signal.SIGKILL, group=False)
            await asyncio.sleep(self.config.poll_interval)
        log.error("shard %s: processes of the engine's group survive SIGKILL", shard.shard_id)

    # ------------------------------------------------------------------- ending
    def _end(self, shard: Shard, outcome: ShardState, reason: str, grace: float) -> None:
        """Decide that the engine must end with ``outcome``; the watch task reports it.

        A second decision can only bring the SIGKILL closer: a ``stop`` that
        arrives during a drain cuts the drain's grace short, never the reverse.
        """
        if shard.end_intent is None:
            shard.end_intent = (outcome, reason)
        kill_at = time.monotonic() + grace
        shard.kill_at = kill_at if shard.kill_at is None else min(shard.kill_at, kill_at)
        shard.kill_changed.set()
        if shard.stopper is None or shard.stopper.done():
            shard.stopper = asyncio.get_running_loop().create_task(self._terminate(shard),
                                                                   name=f"stop {shard.shard_id}")

    async def _terminate(self, shard: Shard) -> None:
        """SIGTERM the group now; SIGKILL it at ``shard.kill_at`` if it has not exited."""
        assert shard.identity is not None
        ident = shard.identity
        if shard.exited.is_set():
            return
        if not signal_verified(ident, signal.SIGTERM, group=True) and not procident.is_same_process(ident):
            log.warning("shard %s: pid %d is no longer the recorded engine; not signalled",
                        shard.shard_id, ident.pid)
        while not shard.exited.is_set():
            assert shard.kill_at is not None
            remaining = shard.kill_at - time.monotonic()
            if remaining <= 0:
                log.warning("shard %s: engine still running after SIGTERM and its grace; sending SIGKILL",
                            shard.shard_id)
                signal_verified(ident, signal.SIGKILL, group=True)
                await shard.exited.wait()
                return
            shard.kill_changed.clear()
            waits = [asyncio.ensure_future(shard.exited.wait()), asyncio.ensure_future(shard.kill_changed.wait())]
            try:
                await asyncio.wait(waits, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()

    async def stop(self, shard_id: str, reason: str = "stop requested", *, drain: bool = False) -> None:
        """Stop (or drain) a shard: SIGTERM its group, SIGKILL after the grace.

        ``drain`` reports ``draining`` at once and gives the engine the longer
        drain grace, in which vLLM's server finishes requests in flight after
        SIGTERM; a plain stop uses the short grace.  A stop for a shard this
        node does not run is answered with ``stopped`` so the control plane
        can let go of it.
        """
        shard = self.shards.get(shard_id)
        if shard is None or shard.state.terminal:
            if shard is not None:
                self.emit(self.status_message(shard))
            else:
                self.emit({"type": "shard_status", "shard_id": shard_id, "state": ShardState.STOPPED.value,
                           "reason": f"not running on this node ({reason})"[:MAX_REASON]})
            return
        if not shard.launched:
            # Nothing runs yet (pending, or fetching weights): cancel the start.
            # Launch and the identity it records happen with no await between
            # them, so "not launched" here cannot hide a fresh engine.
            if shard.lifecycle is not None:
                shard.lifecycle.cancel()
            self._transition(shard, ShardState.STOPPED, f"stopped before launch: {reason}")
            return
        if shard.state is not ShardState.DRAINING:
            self._transition(shard, ShardState.DRAINING, reason)
        grace = self.config.drain_grace if drain else self.config.stop_grace
        self._end(shard, ShardState.STOPPED, reason, grace)
        assert shard.stopper is not None
        await asyncio.shield(shard.stopper)
        # The leader is gone; what is left of its group is being reaped and the terminal
        # state reported. A caller told "stopped" may hand the GPUs on, so wait for that.
        await shard.concluded.wait()

    # ------------------------------------------------------------------ adoption
    def adopt(self, record: ShardRecord) -> Shard:
        """Take over an engine a previous agent launched (identity already verified).

        A still-starting engine keeps its recorded deadline and is probed as a
        fresh one would be; a draining one finishes being stopped.  The log
        says where this agent's supervision begins, so the engine's earlier
        output above it is not mistaken for output of this life.
        """
        assert record.process is not None
        state = ShardState(record.state)
        deadline = record.start_deadline if record.start_deadline is not None else time.monotonic()
        shard = Shard(spec=record.spec, state=state, started_at=record.started_at or time.time(),
                      deadline=deadline, adopted=True, identity=record.process, port=record.port,
                      master_port=record.master_port, argv=record.argv,
                      tls=record.extra.get("tls") is True,
                      launch_marker=str(record.extra.get("launch_marker", "")),
                      log_offset=_offset(record.extra.get("log_offset")))
        self.shards[shard.shard_id] = shard
        self.statedir.log_note(shard.shard_id, f"adopted engine pid {record.process.pid} (start time "
                               f"{record.process.start_time}) in state {state.value} after an agent restart")
        self._persist(shard)
        loop = asyncio.get_running_loop()
        shard.watcher = loop.create_task(self._watch_adopted(shard), name=f"watch {shard.shard_id}")
        if state is ShardState.STARTING:
            shard.lifecycle = loop.create_task(self._await_ready(shard), name=f"start {shard.shard_id}")
        elif state is ShardState.READY:
            self._watch_liveness(shard)
        elif state is ShardState.DRAINING:
            self._end(shard, ShardState.STOPPED, "stop in progress when the previous agent exited",
                      self.config.stop_grace)
        log.info("shard %s: adopted pid %d (%s)", shard.shard_id, record.process.pid, state.value)
        return shard

    # ------------------------------------------------------------------ shutdown
    async def detach(self) -> None:
        """Stop supervising without touching any engine (the agent is exiting).

        Records stay on disk, so the next agent adopts every engine; nothing
        about the agent going away is a reason for an engine to stop.
        """
        tasks = [t for s in self.shards.values() for t in (s.lifecycle, s.watcher, s.stopper, s.monitor)
                 if t and not t.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()


def _offset(value: Any) -> int | None:
    """A recorded log offset, or None (a record from before offsets were kept: the marker is used)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
