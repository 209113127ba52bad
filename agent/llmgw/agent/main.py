"""``llmgw agent``: one node's agent, start to finish, on one event loop.

Order matters and is the point of this module:

1. check the configuration's files (every problem at once) and build the TLS
   context: a node that cannot prove its identity must not start at all;
2. discover the hardware once, so a broken hardware file stops the agent
   here rather than after it adopted engines;
3. recover from the state dir: adopt live engines, drop dead records, kill
   engines nothing describes, *before* anything is advertised; the GPUs of
   one that survives SIGKILL are withheld from every register while it lives,
   and so is every GPU on which NVML lists a process that is not one of this
   agent's engines (never signalled: it is not ours);
4. only then dial the control plane.

SIGTERM and SIGINT end the agent and nothing else: engines run in their own
sessions, their records stay on disk, and the next agent adopts them.  (Under
systemd the unit needs ``KillMode=process`` so the service manager does not
kill the engines itself.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Callable

from llmgw.agent import procident
from llmgw.agent.adoption import (OwnEngines, UnknownEngine, foreign_holders, invisible_holders, recover,
                                  survivor_holds)
from llmgw.agent.kvrelay import KVRelay
from llmgw.agent.kvrelay import targets_of as kv_targets
from llmgw.agent.sickgpus import SickGPUs
from llmgw.agent.statedir import StateDir
from llmgw.agent.stream import StreamClient
from llmgw.agent.supervisor import Supervisor, SupervisorConfig
from llmgw.hardware.advertise import advertise
from llmgw.hardware.gpu_health import GPUHealth, NvmlHealth
from llmgw.hardware.types import HardwareInventory
from llmgw.settings import AgentSettings, EngineTLS

log = logging.getLogger(__name__)


def preflight_problems(settings: AgentSettings) -> list[str]:
    """Every reason the agent cannot start with ``settings``, each naming its file or key."""
    problems: list[str] = []
    if settings.tls is not None:
        for key in ("ca", "cert", "key"):
            path = getattr(settings.tls, key)
            if not Path(path).is_file():
                problems.append(f"tls.{key}: {path} does not exist")
        key_path = Path(settings.tls.key)
        if key_path.is_file() and os.stat(key_path).st_mode & 0o077:
            problems.append(f"tls.key: {key_path} is readable by group or others "
                            f"(mode {os.stat(key_path).st_mode & 0o777:04o}); run: chmod 600 {key_path}")
    if settings.engine_tls is not None:
        problems += engine_tls_problems(settings.engine_tls)
    if settings.gpu_source == "simulated" and settings.hardware_file and not Path(settings.hardware_file).is_file():
        problems.append(f"discovery.hardware_file: {settings.hardware_file} does not exist")
    for engine, cmd in settings.engine_commands.items():
        if cmd and "/" in cmd[0] and not os.access(cmd[0], os.X_OK):
            problems.append(f"engines.{engine}: {cmd[0]} is not an executable file")
    try:
        StateDir(settings.state_dir)
    except OSError as e:
        problems.append(f"state_dir: cannot use {settings.state_dir}: {e.strerror or e}")
    return problems


def engine_tls_problems(etls: EngineTLS) -> list[str]:
    """The engine certificate must load, or every TLS engine would fail minutes into its start."""
    import ssl

    for key in ("cert", "key"):
        if not Path(getattr(etls, key)).is_file():
            return [f"engine_tls.{key}: {getattr(etls, key)} does not exist"]
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(etls.cert, etls.key)
    except (OSError, ssl.SSLError) as e:
        return [f"engine_tls: cannot load certificate {etls.cert} with key {etls.key}: {e}"]
    return []


def _discover_sync(settings: AgentSettings) -> HardwareInventory:
    from llmgw.hardware.discover import discover

    return discover(settings.node_id, gpu_source=settings.gpu_source,  # type: ignore[arg-type]
                    hardware_file=settings.hardware_file, sysfs_root=settings.sysfs_root,
                    fabrics=settings.fabrics)


def own_engines(supervisor: Supervisor, node_id: str) -> OwnEngines:
    """The engines ``supervisor`` runs or adopted, right now."""
    return OwnEngines.of(node_id, [(s.shard_id, s.identity) for s in supervisor.live_shards()])


class _Discovery:
    """Rediscovers on every connection; a failure then reuses the last good inventory.

    GPUs held by ``survivors`` (unidentified engines that outlived SIGKILL)
    are left out of what is advertised for as long as each one lives, and so
    are GPUs on which discovery lists a process that ``own`` (this agent's
    engines, asked afresh each time) does not cover, until discovery no
    longer lists it.
    """

    def __init__(self, settings: AgentSettings, first: HardwareInventory,
                 survivors: list[UnknownEngine] | None = None,
                 own: Callable[[], OwnEngines] | None = None):
        self.settings = settings
        self.last = first
        self.survivors = list(survivors or ())
        self.own = own or (lambda: OwnEngines(settings.node_id))
        self.foreign: set[tuple[int, int]] = set()  # (GPU, pid) withheld at the last advertisement
        self.invisible: set[tuple[int, int]] = set()  # (GPU, pid) already logged as not in our pid namespace
        self.sick = SickGPUs()
        self.nvml_health = NvmlHealth() if settings.gpu_source == "nvml" else None
        self.last_health: dict[int, GPUHealth] | None = None

    def health_of(self, inventory: HardwareInventory) -> dict[int, GPUHealth]:
        """Each GPU's health by index: NVML's answers now, or what the hardware file says (blocking)."""
        if inventory.gpu_source == "nvml":
            return self.nvml_health.read() if self.nvml_health is not None else {}
        return {g.index: g.health for g in inventory.gpus if g.health is not None}

    def _read(self) -> tuple[HardwareInventory, dict[int, GPUHealth]]:
        inventory = _discover_sync(self.settings)
        return inventory, self.health_of(inventory)

    def advertised(self, inventory: HardwareInventory,
                   health: dict[int, GPUHealth] | None = None) -> HardwareInventory:
        if health is None:
            health = self.last_health if self.last_health is not None else self.health_of(inventory)
        self.last_health = health
        latched, since = self.sick.judge(health)
        alive = [e for e in self.survivors if procident.is_running(e.identity)]
        for e in self.survivors:
            if e not in alive:
                log.warning("unidentified engine pid %d that survived SIGKILL is gone; its GPUs are advertised "
                            "again", e.identity.pid)
        self.survivors = alive
        own = self.own()
        out = advertise(inventory, health=latched, since=since, held=lambda inv: survivor_holds(inv, alive),
                        foreign=lambda inv: foreign_holders(inv, own))
        shown, holders = out.inventory, list(out.holders)
        now = {(h.gpu, h.pid) for h in holders}
        for h in holders:
            if (h.gpu, h.pid) not in self.foreign:
                used = "unknown" if h.used_memory_bytes is None else f"{h.used_memory_bytes / (1 << 30):.2f} GiB"
                log.warning("GPU %d withheld: in use by %s, not an llmgw engine (GPU memory used: %s); "
                            "it is not signalled, and the GPU is advertised again once it is gone",
                            h.gpu, h.describe(), used)
        for gpu, pid in sorted(self.foreign - now):
            if gpu not in {h.gpu for h in holders}:
                log.warning("GPU %d: pid %d no longer uses it; advertised again", gpu, pid)
        self.foreign = now
        for h in invisible_holders(inventory):
            if (h.gpu, h.pid) not in self.invisible:
                self.invisible.add((h.gpu, h.pid))
                log.warning("GPU %d: NVML lists pid %d, which does not exist in this agent's pid namespace: not "
                            "counted (inside a container NVML reports host pids; run the agent in the host's pid "
                            "namespace, e.g. --pid=host, so processes on its GPUs can be told apart)", h.gpu, h.pid)
        return shown

    async def __call__(self) -> HardwareInventory:
        health = None
        try:
            self.last, health = await asyncio.to_thread(self._read)
        except Exception as e:
            log.error("hardware discovery failed; registering the last inventory: %s", e)
        return self.advertised(self.last, health)


async def agent_main(settings: AgentSettings, stop: asyncio.Event | None = None) -> int:
    from llmgw.config import ConfigInvalid
    from llmgw.tls import RevocationError, Revocations, TLSConfigError, control_plane_context

    problems = preflight_problems(settings)
    ssl_context = None
    revocations = Revocations(None)
    if settings.tls is not None and not problems:
        try:
            revocations = Revocations(settings.tls.revoked)
            # the control plane must hold the server role and not be revoked, checked before register
            ssl_context = control_plane_context(settings.tls.ca, settings.tls.cert, settings.tls.key,
                                                revocations=revocations)
        except RevocationError as e:
            problems.append(f"tls.revoked: {e}")
        except TLSConfigError as e:
            problems.append(f"tls: {e}")
    if settings.insecure_no_tls:
        log.warning("INSECURE: insecure_no_tls is set: the stream to %s is plaintext and this node proves "
                    "no identity; development only", settings.control_plane_url)
    try:
        inventory = await asyncio.to_thread(_discover_sync, settings)
    except (ConfigInvalid, ValueError, OSError) as e:
        problems.append(f"discovery: {e}")
    if problems:
        print(f"llmgw agent: cannot start ({len(problems)} problem(s)):", file=sys.stderr)
        for p in problems:
            print(f"  {p}", file=sys.stderr)
        return 2

    statedir = StateDir(settings.state_dir)
    recovered = await recover(statedir, settings.node_id, settings.engine_commands)
    for e in recovered.killed:
        log.warning("killed unidentified engine pid %d before registering: %s", e.identity.pid, e.why)

    stream: StreamClient | None = None

    def emit(msg: dict) -> None:
        if stream is not None:
            stream.send(msg)

    supervisor = Supervisor(SupervisorConfig.from_settings(settings), statedir, emit)
    for rec in recovered.adopted:
        supervisor.adopt(rec)
    discovery = _Discovery(settings, inventory, recovered.survivors,
                           own=lambda: own_engines(supervisor, settings.node_id))
    shown = discovery.advertised(inventory, await asyncio.to_thread(discovery.health_of, inventory))
    if len(shown.gpus) < len(inventory.gpus):
        log.error("advertising %d of %d GPU(s): %s", len(shown.gpus), len(inventory.gpus), shown.gpu_reason)
    stream = StreamClient(url=settings.control_plane_urls or settings.control_plane_url, node_id=settings.node_id,
                          address=settings.advertise_address, ssl_context=ssl_context,
                          supervisor=supervisor, discover=discovery,
                          reconnect_initial=settings.reconnect_initial, reconnect_max=settings.reconnect_max,
                          keepalive=settings.keepalive_interval, rediscover=settings.rediscover_interval)

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    with contextlib.suppress(NotImplementedError, RuntimeError):
        # SIGHUP re-reads the revocation list (checked at the next handshake); it used to end the agent
        loop.add_signal_handler(signal.SIGHUP, revocations.reload)
    log.info("agent %s: %d engine(s) adopted, %d record(s) removed, %d unidentified engine(s) killed",
             settings.node_id, len(recovered.adopted), len(recovered.removed), len(recovered.killed))
    # KV events stay on the node: only opaque route keys go up the stream (agent/kvrelay.py)
    relay = KVRelay(targets=lambda: kv_targets(supervisor), send=stream.send, current_stream=lambda: stream.ws)
    stream.on_kv_routes_accepted = relay.accepted  # type: ignore[method-assign]
    runner = asyncio.create_task(stream.run_forever(), name="stream")
    relaying = asyncio.create_task(relay.run(), name="kv relay")
    stopper = asyncio.create_task(stop.wait(), name="stop")
    await asyncio.wait({runner, stopper}, return_when=asyncio.FIRST_COMPLETED)
    for t in (runner, relaying, stopper):
        t.cancel()
    await asyncio.gather(runner, relaying, stopper, return_exceptions=True)
    await supervisor.detach()
    log.info("agent %s exiting; %d engine(s) left running for the next agent to adopt",
             settings.node_id, len(supervisor.live_shards()))
    return 0


def run_agent(settings: AgentSettings) -> int:
    """Run the agent until SIGTERM/SIGINT; the exit status (2: could not start)."""
    return asyncio.run(agent_main(settings))
