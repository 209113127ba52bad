"""A shard's lifecycle on this node: accept, check, launch, wait, stop; report every transition.

One ``Shard`` per shard id, driven by tasks on the agent's single event loop:

* a *lifecycle* task takes a start from ``pending`` to ``starting`` (checks,
  weights, launch, record) and then waits for readiness until the start
  deadline;
* a *watch* task notices the engine's exit and is the only place that
  reports the terminal state of a launched shard, so a timeout, a stop and a
  crash can never produce two conflicting reports.

Everything that touches the engine itself (launching it, probing it, signalling
it, tailing its output) is the ``EngineDriver``'s (``driver.py``): by default
``PopenDriver``, engines as process groups of this node; the fleet simulator
passes its timed engine.  The supervisor keeps the state table, the start
deadline, what an end is reported as, and the record on disk.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Iterable

from llmgw import compat
from llmgw.agent import liveness
from llmgw.agent.driver import Emit, EngineDriver, LaunchRefused, Readiness
from llmgw.agent.popendriver import ENV_NODE_ID, ENV_REPLICA_ID, ENV_SHARD_ID, PopenDriver
from llmgw.agent.probe import is_loopback
from llmgw.agent.shard import Shard, SupervisorConfig, spec_model, spec_profile
from llmgw.agent.shardstate import ShardState, check_transition, exit_outcome
from llmgw.agent.statedir import ShardRecord, ShardStore
from llmgw.catalog import Model, Profile, SourceKind, source_kind

log = logging.getLogger(__name__)

# Imported by name from here (adoption, tests): the supervisor's vocabulary.
__all__ = ["ENV_NODE_ID", "ENV_REPLICA_ID", "ENV_SHARD_ID", "Emit", "Shard", "Supervisor", "SupervisorConfig",
           "spec_model", "spec_profile"]

URL_SOURCE_UNAVAILABLE = "https sources are fetched before launch by the weights fetcher (not available in this build)"

MAX_REASON = 4096
MAX_TAIL = 65536


class Supervisor:
    """Every shard on this node.  ``emit`` receives each ``shard_status`` message."""

    def __init__(self, config: SupervisorConfig, statedir: ShardStore, emit: Emit,
                 driver: EngineDriver | None = None):
        self.config = config
        self.statedir = statedir
        self.emit = emit
        self.driver: EngineDriver = driver if driver is not None else PopenDriver(config, statedir)
        self.shards: dict[str, Shard] = {}
        # Optional shard_status fields the control plane on the current stream said it accepts
        # (``accepts``): agents upgrade first, and an older control plane closes the stream on a
        # field it does not know.
        self.accepted: frozenset[str] = frozenset()

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
        if shard.engine_version is not None and "engine_version" in self.accepted:
            msg["engine_version"] = shard.engine_version
        if shard.side_port is not None and shard.identity is not None and "side_port" in self.accepted:
            msg["side_port"] = shard.side_port
        if shard.spec.get("sleep_mode") and shard.port and "sleeping" in self.accepted:
            msg["sleeping"] = shard.sleeping and shard.state is ShardState.READY
        if reason:
            msg["reason"] = reason[:MAX_REASON]
        if output_tail is not None:
            msg["output_tail"] = output_tail[-MAX_TAIL:]
        return msg

    def accept_fields(self, fields: Iterable[str]) -> None:
        """What the control plane on this stream accepts; the Ready shards' versions and the running
        shards' side-channel ports go to one that newly takes them (its ``register`` went out before it
        could say so)."""
        before, self.accepted = self.accepted, frozenset(fields)
        new = self.accepted - before
        for shard in self.live_shards():
            if (("engine_version" in new and shard.state is ShardState.READY and shard.engine_version is not None)
                    or ("side_port" in new and shard.side_port is not None and shard.identity is not None)):
                self.emit(self.status_message(shard))

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
        return {p for s in self.live_shards() for p in (s.port, s.master_port, s.side_port) if p}

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
                                    "tls": shard.tls, "engine_version": shard.engine_version,
                                    "side_port": shard.side_port}))

    def _tail(self, shard: Shard) -> str:
        tail = self.driver.tail(shard)
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
                self.fail_before_launch(shard, f"agent error while starting: {type(e).__name__}: {e}")

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
            self.fail_before_launch(shard, problem)
            return None
        return model, profile

    # ---------------------------------------------------------------- weights
    def fetching(self, shard: Shard) -> None:
        """Report ``fetching`` (a driver's weights step)."""
        self._transition(shard, ShardState.FETCHING)

    def fail_before_launch(self, shard: Shard, reason: str) -> None:
        """Report ``failed`` for a shard whose engine was never launched."""
        self._transition(shard, ShardState.FAILED, reason, output_tail="")

    async def fetch_weights(self, shard: Shard, model: Model) -> str | None:
        """The model path to hand the engine, or None after failing the shard."""
        from llmgw.engines import SourceError, resolve_model_path

        kind = source_kind(model.source)
        if kind is SourceKind.URL:
            try:
                from llmgw.agent import fetch
            except ImportError:
                self.fail_before_launch(shard, URL_SOURCE_UNAVAILABLE)
                return None
            # The weights fetcher's contract: download (single-flight, resumable,
            # verified) into model_dir, emit ``progress`` messages through
            # ``progress``, return the local path, raise with a reason on failure.
            self.fetching(shard)
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
                self.fail_before_launch(shard, f"not ready within start_timeout ({timeout:g}s): still fetching "
                                               f"{model.source}")
                return None
            except Exception as e:
                self.fail_before_launch(shard, f"fetching {model.source}: {e}")
                return None
        if kind in (SourceKind.REPO, SourceKind.HF):
            return await self._fetch_repository(shard, model)
        try:
            return resolve_model_path(model, self.config.model_dir)
        except SourceError as e:
            self.fail_before_launch(shard, str(e))
            return None

    async def _fetch_repository(self, shard: Shard, model: Model) -> str | None:
        """A repository's local directory (a mirror with a manifest, or hf://); None after failing the shard.

        Unlike a single file, a repository (tens of shards, hundreds of GiB) is
        fetched outside ``start_timeout``: the fetcher's own stall and attempt
        limits end a fetch that cannot finish, and the start clock begins when
        the engine is launched on the complete directory.
        """
        from llmgw.agent import fetch

        self.fetching(shard)
        try:
            path = await fetch.fetch_repository(model, self.config.model_dir, progress=self.emit,
                                                shard_id=shard.shard_id, node_id=self.config.node_id,
                                                policy=self.config.fetch)
        except Exception as e:
            self.fail_before_launch(shard, f"fetching {model.source}: {e}")
            return None
        shard.deadline = time.monotonic() + float(shard.spec["profile"]["start_timeout"])
        return path

    # ------------------------------------------------------------------ launch
    async def _launch(self, shard: Shard) -> bool:
        checked = self._checked(shard)
        if checked is None:
            return False
        model, profile = checked
        model_path = await self.driver.prepare(shard, model, self)
        if model_path is None or shard.state.terminal:
            return False
        if time.monotonic() >= shard.deadline:
            self.fail_before_launch(shard, f"start_timeout of {profile.start_timeout:g}s passed before launch")
            return False
        try:
            started = self.driver.start(shard, model, profile, model_path, self._ports_held())
        except LaunchRefused as e:
            self.fail_before_launch(shard, str(e))
            return False
        # Launch and the identity it records happen with no await between them (see ``stop``).
        shard.identity, shard.handle, shard.argv = started.identity, started.handle, started.argv
        shard.port, shard.master_port, shard.tls = started.port, started.master_port, started.tls
        shard.side_port = started.side_port
        shard.launch_marker, shard.log_offset = started.launch_marker, started.log_offset
        self._transition(shard, ShardState.STARTING)  # persists the record with pid + start time
        shard.watcher = self.driver.watch(shard, self._conclude)
        return True

    # ---------------------------------------------------------------- readiness
    async def _await_ready(self, shard: Shard) -> None:
        """Wait for the driver to find the engine ready; fail it when the start deadline passes first.

        The deadline was fixed when the start was accepted (and survives an
        agent restart through the record); nothing observed while waiting,
        download progress included, ever moves it.
        """
        readiness = await self.driver.wait_ready(shard)
        if readiness is Readiness.READY:
            self._transition(shard, ShardState.READY)
        elif readiness is Readiness.TIMED_OUT:
            timeout = float(shard.spec["profile"]["start_timeout"])
            why = f"not ready within start_timeout ({timeout:g}s)"
            if shard.last_probe:
                why += f"; last probe: {shard.last_probe}"
            self._end(shard, ShardState.FAILED, why, self.config.stop_grace)

    # ------------------------------------------------------------------ liveness
    def _watch_liveness(self, shard: Shard) -> None:
        if not self.driver.health_checked(shard):
            return
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
            check = await self.driver.check(shard, live.progress)
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

    # ------------------------------------------------------------------ the end
    async def _conclude(self, shard: Shard, exit_desc: str) -> None:
        """The leader exited (the driver says how): clear out what is left, then report the terminal state once."""
        shard.exit_desc = exit_desc
        shard.exited.set()
        try:
            await self._settle(shard, exit_desc)
        finally:
            shard.concluded.set()

    async def _settle(self, shard: Shard, exit_desc: str) -> None:
        await self.driver.reap(shard)
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

    # ------------------------------------------------------------------- ending
    def _end(self, shard: Shard, outcome: ShardState, reason: str, grace: float) -> None:
        """Decide that the engine must end with ``outcome``; the watch task reports it.

        A second decision can only bring the SIGKILL closer: a ``stop`` that
        arrives during a drain cuts the drain's grace short, never the reverse.
        """
        if shard.end_intent is None:
            shard.end_intent = (outcome, reason)
        # A health check in flight ends with the decision: its requests would hold the engine's
        # exit (llama-server joins every open request before it exits, and a /metrics request
        # waits on a scheduler that SIGTERM has stopped), turning a clean stop into a SIGKILL.
        monitor = shard.monitor
        if monitor is not None and not monitor.done() and monitor is not asyncio.current_task():
            monitor.cancel()
        kill_at = time.monotonic() + grace
        shard.kill_at = kill_at if shard.kill_at is None else min(shard.kill_at, kill_at)
        shard.kill_changed.set()
        if shard.stopper is None or shard.stopper.done():
            shard.stopper = asyncio.get_running_loop().create_task(self.driver.stop(shard, self._conclude),
                                                                   name=f"stop {shard.shard_id}")

    async def stop(self, shard_id: str, reason: str = "stop requested", *, drain: bool = False) -> None:
        """Stop (or drain) a shard: the driver asks the engine to end (SIGTERM), and ends it after the grace.

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
                      engine_version=_version(record.extra.get("engine_version")),
                      launch_marker=str(record.extra.get("launch_marker", "")),
                      log_offset=_offset(record.extra.get("log_offset")),
                      side_port=_port(record.extra.get("side_port")))
        self.shards[shard.shard_id] = shard
        self.statedir.log_note(shard.shard_id, f"adopted engine pid {record.process.pid} (start time "
                               f"{record.process.start_time}) in state {state.value} after an agent restart")
        self._persist(shard)
        loop = asyncio.get_running_loop()
        shard.watcher = self.driver.recover(shard, self._conclude)
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
        await self.driver.close()


def _offset(value: Any) -> int | None:
    """A recorded log offset, or None (a record from before offsets were kept: the marker is used)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _port(value: Any) -> int | None:
    """A recorded side-channel port, or None (none was allocated, or a record from before they were kept)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536 else None


def _version(value: Any) -> str | None:
    """A recorded engine version, or None (a record from before versions were read, or none was given)."""
    return value if isinstance(value, str) and value else None
