"""The engine driver for real engines: one process group per shard, on this node.

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

Readiness is a real one-token completion (``/health`` is 200 long before a
model can generate); liveness after Ready is ``/health`` plus progress on
``/metrics`` for rank 0, the process state for the other ranks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import subprocess
import time
from typing import Any

import aiohttp

from llmgw import compat, promtext
from llmgw.agent import liveness, procident
from llmgw.agent.driver import ExitReport, LaunchRefused, LaunchSteps, Readiness, Started
from llmgw.agent.ports import choose_port
from llmgw.agent.probe import EngineTLSClient, base_url, completion_probe, engine_version, get_text, probe_host
from llmgw.agent.procident import ProcessIdentity
from llmgw.agent.shard import Shard, SupervisorConfig
from llmgw.agent.shardstate import ShardState
from llmgw.agent.statedir import ShardStore, socket_dir
from llmgw.catalog import Model, Profile, SourceKind
from llmgw.tls.files import write_atomic

log = logging.getLogger(__name__)

# Environment markers on every engine this agent launches.  They are how a
# later agent recognises an engine of this node that no record describes
# (see adoption.py), and how a straggler of a dead engine's group is told
# apart from an unrelated process.
ENV_NODE_ID = "LLMGW_NODE_ID"
ENV_SHARD_ID = "LLMGW_SHARD_ID"
ENV_REPLICA_ID = "LLMGW_REPLICA_ID"


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


def group_members(leader: ProcessIdentity, shard_id: str, node_id: str) -> list[ProcessIdentity]:
    """Live processes left in the group ``leader`` led, once the leader is gone.

    Used once the group leader is gone (a dead engine's workers still holding
    GPUs): with the leader's identity unverifiable, a process is signalled
    only if it is in that group and that session (the engine was started in a
    session of its own; no process can join one from outside, and the kernel
    hands out no pid still naming a live session), started no earlier than
    the leader, and carries no other shard's markers.  The markers cannot be
    required: vLLM names its processes with setproctitle, which writes the
    title over the environment block, so ``/proc/<pid>/environ`` of an
    ``EngineCore`` or a worker reads empty.
    """
    out = []
    pgid = leader.pid
    for pid in procident.list_pids():
        st = procident.read_stat(pid)
        if (st is None or st.pgid != pgid or st.sid != pgid or st.state in ("Z", "X")
                or st.start_time < leader.start_time):
            continue
        env = procident.read_environ(pid) or {}
        if env.get(ENV_SHARD_ID, shard_id) == shard_id and env.get(ENV_NODE_ID, node_id) == node_id:
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


def offline_env(model: Model) -> dict[str, str]:
    """An engine on a fetched repository loads it as it is: no hub behind the agent's back."""
    if model.kind not in (SourceKind.REPO, SourceKind.HF):
        return {}
    from llmgw.agent.fetch import OFFLINE_ENV

    return dict(OFFLINE_ENV)


def _probe_fields(shard: Shard) -> dict[str, Any]:
    """What the shard's engine needs on a probe's completion (an SGLang prefill/decode server: a fake peer)."""
    from llmgw.engines import ProfileError, get_adapter

    profile = shard.spec.get("profile", {})
    try:
        return get_adapter(str(profile.get("engine"))).probe_fields(profile)
    except ProfileError:  # an engine this agent does not know was refused at the start
        return {}


class PopenDriver:
    """Engines as process groups of this node, their output in the state directory's logs."""

    def __init__(self, config: SupervisorConfig, statedir: ShardStore):
        self.config = config
        self.statedir = statedir
        self._session: aiohttp.ClientSession | None = None
        self._tls_client: EngineTLSClient | None = None

    # ------------------------------------------------------------------ launch
    async def prepare(self, shard: Shard, model: Model, steps: LaunchSteps) -> str | None:
        return await steps.fetch_weights(shard, model)

    def start(self, shard: Shard, model: Model, profile: Profile, model_path: str,
              ports_held: set[int]) -> Started:
        from llmgw.engines import LaunchContext, LaunchContextError, ProfileError, build_launch

        spec = shard.spec
        rank, nnodes = int(spec["rank"]), int(spec["nnodes"])
        first, last = self.config.engine_ports
        taken = set(ports_held)
        port = 0
        if rank == 0:
            chosen = choose_port(first, last, self.config.engine_bind_host, taken)
            if chosen is None:
                raise LaunchRefused(f"no free engine port in {first}-{last}")
            port = chosen
            taken.add(port)
        side_channel = None
        if profile.kv_transfer is not None and rank == 0:
            # One side of a prefill/decode pair: its peers reach the side channel at the node's address.
            side_port = choose_port(first, last, self.config.engine_bind_host, taken)
            if side_port is None:
                raise LaunchRefused(f"no free KV-transfer side-channel port in {first}-{last}")
            taken.add(side_port)
            side_channel = (self.config.advertise_address, side_port)
        master_addr, master_port = spec.get("master_addr"), spec.get("master_port")
        if nnodes > 1 and rank == 0:
            master_addr = master_addr or self.config.advertise_address
            if master_port is None:
                master_port = choose_port(first, last, self.config.engine_bind_host, taken)
                if master_port is None:
                    raise LaunchRefused(f"no free rendezvous port in {first}-{last}")
        try:
            launch = build_launch(model, profile, LaunchContext(
                host=self.config.engine_bind_host, port=port, model_path=model_path, rank=rank,
                nnodes=nnodes, master_addr=master_addr, master_port=master_port,
                gpu_indices=tuple(int(g) for g in spec.get("gpu_indices", ())),
                extra_env=dict(spec.get("env", {})),
                command=self.config.engine_commands.get(profile.engine),
                api_key=spec.get("api_key") or None,
                secret_dir=str(self.statedir.secret_dir(shard.shard_id)),
                shard_id=shard.shard_id,
                socket_dir=str(socket_dir(self.statedir.root, shard.shard_id)) if profile.kv_events else None,
                kv_side_channel=side_channel,
                sleep_mode=bool(spec.get("sleep_mode")),
                **self._tls_files(profile)))
        except (ProfileError, LaunchContextError) as e:
            raise LaunchRefused(str(e)) from e

        for f in launch.files:
            write_atomic(f.path, f.data.encode(), mode=0o600)
        # the agent's own environment, less what the adapter owns: only the launch may set those
        inherited = {k: v for k, v in os.environ.items() if k not in launch.owned_env}
        env = {**inherited, **launch.env, **offline_env(model), ENV_NODE_ID: self.config.node_id,
               ENV_SHARD_ID: shard.shard_id, ENV_REPLICA_ID: str(spec["replica_id"])}
        marker = f"launch {secrets.token_hex(8)}"
        log_fd = self.statedir.open_log(shard.shard_id)
        offset = os.fstat(log_fd).st_size
        self.statedir.log_note(shard.shard_id, f"{marker} of shard {shard.shard_id} at "
                               f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} (engine log from byte {offset}): "
                               f"{' '.join(launch.argv)}")
        try:
            popen = subprocess.Popen(list(launch.argv), env=env, stdin=subprocess.DEVNULL, stdout=log_fd,
                                     stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
                                     cwd=str(self.statedir.root))
        except OSError as e:
            raise LaunchRefused(f"cannot launch {launch.argv[0]!r}: {e}") from e
        finally:
            os.close(log_fd)
        identity = procident.identify(popen.pid)
        if identity is None:  # exited and was reaped already? Popen has not waited, so it is a zombie at worst
            identity = ProcessIdentity(popen.pid, 0, procident.boot_id())
        return Started(identity=identity, port=launch.port if launch.serves_http else None,
                       master_port=master_port if rank == 0 and nnodes > 1 else None, argv=tuple(launch.argv),
                       tls=launch.tls, launch_marker=marker, log_offset=offset, handle=popen,
                       side_port=side_channel[1] if side_channel else None)

    def _tls_files(self, profile: Profile) -> dict[str, str]:
        """The engine certificate for the adapter, when this node has one and gives it to this engine."""
        etls = self.config.engine_tls
        if etls is None or profile.engine not in etls.engines:
            return {}
        return {"tls_cert": etls.cert, "tls_key": etls.key}

    # ---------------------------------------------------------------- watching
    def watch(self, shard: Shard, exited: ExitReport) -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(self._watch_child(shard, exited),
                                                      name=f"watch {shard.shard_id}")

    def recover(self, shard: Shard, exited: ExitReport) -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(self._watch_adopted(shard, exited),
                                                      name=f"watch {shard.shard_id}")

    async def _watch_child(self, shard: Shard, exited: ExitReport) -> None:
        """Wait for a child of ours to exit (pidfd, else polling), then report it."""
        popen = shard.handle
        assert isinstance(popen, subprocess.Popen)
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
        await exited(shard, describe_exit(popen.returncode))

    async def _watch_adopted(self, shard: Shard, exited: ExitReport) -> None:
        """An adopted engine is not our child: poll its identity until it is gone."""
        assert shard.identity is not None
        while procident.is_running(shard.identity):
            await asyncio.sleep(self.config.poll_interval)
        await exited(shard, describe_exit(None))

    # --------------------------------------------------------------- readiness
    async def wait_ready(self, shard: Shard) -> Readiness:
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
                return Readiness.TIMED_OUT
            if shard.port:
                res = await completion_probe(self._http(), url, served, min(self.config.probe_timeout, remaining),
                                             shard.spec.get("api_key"), self._engine_tls(shard), _probe_fields(shard))
                ok, shard.last_probe = res.ok, res.detail
            else:  # ranks > 0 serve no HTTP: liveness is all there is to check
                ok = shard.identity is not None and procident.is_running(shard.identity)
            if shard.exited.is_set() or shard.end_intent is not None or shard.state is not ShardState.STARTING:
                return Readiness.ENDED
            if ok:
                if shard.port:
                    shard.engine_version = await engine_version(
                        self._http(), url, str(shard.spec["profile"]["engine"]),
                        self.config.health.timeout, shard.spec.get("api_key"), self._engine_tls(shard))
                return Readiness.READY
            wait = min(self.config.probe_interval, max(0.0, shard.deadline - time.monotonic()))
            try:
                await compat.wait_for(shard.exited.wait(), timeout=wait)
            except (TimeoutError, asyncio.TimeoutError):
                pass
        return Readiness.ENDED

    # ---------------------------------------------------------------- liveness
    def health_checked(self, shard: Shard) -> bool:
        return True

    async def check(self, shard: Shard, before: liveness.Progress | None) -> liveness.Check:
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
        progress = (liveness.progress_from_samples(promtext.totals(body, liveness.READ), engine)
                    if status == 200 else None)
        if progress is None:  # nothing to read progress from: serving one token is the proof
            res = await completion_probe(self._http(), url, str(shard.spec["model"]["served_name"]), timeout,
                                         shard.spec.get("api_key"), tls, _probe_fields(shard))
            return liveness.Check(res.ok, res.detail)
        return liveness.judge_engine(True, "ok", before, progress)

    def engine_request(self, shard: Shard) -> tuple[aiohttp.ClientSession, str, dict[str, Any]]:
        """(session, base URL, request kwargs: engine key and TLS) to call rank 0 as the probes do."""
        key = shard.spec.get("api_key")
        kwargs: dict[str, Any] = {"headers": {"Authorization": f"Bearer {key}"}} if key else {}
        tls = self._engine_tls(shard)
        if tls is not None:
            kwargs.update(tls.request_kwargs())
        return self._http(), self._engine_url(shard), kwargs

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

    # ------------------------------------------------------------------ ending
    async def stop(self, shard: Shard, exited: ExitReport) -> None:
        """SIGTERM the group now; SIGKILL it at ``shard.kill_at`` if it has not exited (the watch reports)."""
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

    async def reap(self, shard: Shard) -> None:
        """SIGKILL whatever is left of the engine's process group and wait until it is empty.

        A terminal state promises the control plane the shard's GPUs are free;
        a worker that outlived its leader would make that a lie.
        """
        assert shard.identity is not None
        for _ in range(int(30 / self.config.poll_interval) + 1):
            members = group_members(shard.identity, shard.shard_id, self.config.node_id)
            if not members:
                return
            for m in members:
                log.warning("shard %s: killing leftover process %d of the engine's group", shard.shard_id, m.pid)
                signal_verified(m, signal.SIGKILL, group=False)
            await asyncio.sleep(self.config.poll_interval)
        log.error("shard %s: processes of the engine's group survive SIGKILL", shard.shard_id)

    def tail(self, shard: Shard) -> str:
        return self.statedir.log_tail(shard.shard_id, self.config.tail_bytes, since_offset=shard.log_offset,
                                      since_marker=None if shard.log_offset is not None
                                      else shard.launch_marker or None)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

