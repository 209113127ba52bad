"""The simulated agents of one process, and the requests that drive them.

A ``Worker`` runs its share of the fleet on one event loop, its agents
dialling through ``aiohttp`` sessions (no limit on connections: each agent
holds exactly one WebSocket).  Against a control plane on an IPv4 loopback
address each agent dials from a loopback address of its own
(``source_address``, ``nodes_per_address`` of them to one), as agents on
their own machines do: from one address, 10,000 agents met the control
plane's per-source connection cap (128 unverified connections) and were
aborted 59,110 times in one cold start, a cost no real fleet pays.  It answers
requests (``handle``): ``stats``, ``nodes`` and the fault operations, each
naming the node numbers it applies to.  The same requests reach it in the
simulator's own process, or as JSON lines on stdin when it runs as one of
``--procs`` worker processes (``python -m llmgw.sim.fleet.worker SPEC``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from llmgw.agent.shardstate import ShardState
from llmgw.agent.stream import stream_session
from llmgw.sim.fleet.certs import ContextFactory, load_credentials
from llmgw.sim.fleet.hardware import load_templates, node_inventory
from llmgw.sim.fleet.node import SimNode, SimStreamClient, discover_for
from llmgw.sim.fleet.shards import Counters, EngineSample, SimSupervisor, Timings, supervisor_config

log = logging.getLogger(__name__)

OPS = ("stats", "nodes", "silence", "heal", "kill", "restart", "flap", "slow", "malformed", "oversized", "close")


def source_address(number: int, nodes_per_address: int) -> str:
    """The loopback address node ``number`` dials from: 127.1.0.0 on, ``nodes_per_address`` to one."""
    k = number // nodes_per_address
    return f"127.{1 + k // 65536}.{k // 256 % 256}.{k % 256}"


def loopback_v4(urls: str | list[str]) -> bool:
    """Whether every control-plane address is an IPv4 loopback literal (where 127.x.y.z can dial it)."""
    for url in [urls] if isinstance(urls, str) else urls:
        try:
            ip = ipaddress.ip_address(urlsplit(url).hostname or "")
        except ValueError:
            return False
        if ip.version != 4 or not ip.is_loopback:
            return False
    return True


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs; JSON-serialisable so a worker process can read it from a file."""

    url: str | list[str]  # several: a leader and its standbys, in the agent's order
    ca_file: str
    cert_cache: str
    ca_fingerprint: str
    node_ids: list[str]  # the whole fleet, by node number
    templates: list[str]  # template name of each node, by node number
    extra_templates: dict[str, str]
    numbers: list[int]  # the node numbers this worker runs
    timings: dict[str, float] = field(default_factory=dict)
    reconnect_initial: float = 1.0
    reconnect_max: float = 30.0
    keepalive: float = 10.0
    ramp: float = 0.0
    engines: int = 0
    engine_command: list[str] = field(default_factory=list)
    engine_dir: str | None = None
    engine_models: list[str] = field(default_factory=list)
    engine_ports: tuple[int, int] = (40000, 49999)
    model_dir: str = "/nonexistent-model-dir"
    nodes_per_address: int = 1  # agents dialling from one loopback address; 0: all from the kernel's choice
    hold: bool = False  # build every agent, dial only at ``go``

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "WorkerSpec":
        d = json.loads(text)
        d["engine_ports"] = tuple(d["engine_ports"])
        return cls(**d)


def raise_fd_limit(need: int) -> None:
    """One socket per agent: lift the soft open-files limit as far as needed (and allowed)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        if target < need:
            log.error("open files limited to %d (hard limit) but %d agents need about %d: some will fail to "
                      "connect; raise the limit (ulimit -Hn) or use more --procs", target, need - 64, need)


class Worker:
    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.nodes: dict[int, SimNode] = {}
        self.sent: Counter = Counter()
        self.counters = Counters()
        self.timings = Timings(**spec.timings)
        self.engines = EngineSample(spec.engines, tuple(spec.engine_command),
                                    Path(spec.engine_dir) if spec.engine_dir else None, tuple(spec.engine_models))
        self.sessions: dict[str | None, aiohttp.ClientSession] = {}  # by source address (None: the kernel's)
        self.contexts: ContextFactory | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------------ start
    async def start(self) -> None:
        spec = self.spec
        raise_fd_limit(len(spec.numbers) + 2 * spec.engines + 64)
        templates = load_templates(spec.extra_templates)
        ids = [spec.node_ids[n] for n in spec.numbers]
        creds = load_credentials(spec.cert_cache, spec.ca_fingerprint, ids)
        self.contexts = ContextFactory(spec.ca_file)
        for n in spec.numbers:
            node_id = spec.node_ids[n]
            template = templates[spec.templates[n]]
            ctx = self.contexts.context(creds[node_id])
            self.nodes[n] = self._node(n, node_id, template, ctx)
        self.contexts.close()
        if not spec.hold:
            await self.go()

    async def go(self) -> None:
        """Every agent not started yet makes its first dial, spread over ``ramp`` seconds."""
        spec = self.spec
        order = [node for node in self.nodes.values() if node.lives == 0]
        for i, node in enumerate(order):
            node.start()
            if spec.ramp > 0 and i + 1 < len(order):
                await asyncio.sleep(spec.ramp / len(order))

    def _node(self, number: int, node_id: str, template: dict[str, Any], ctx: Any) -> SimNode:
        spec = self.spec
        config = supervisor_config(node_id, tuple(spec.engine_command), spec.model_dir, spec.engine_ports)

        def make_client(node: SimNode) -> SimStreamClient:
            return SimStreamClient(
                sent=self.sent, url=spec.url, node_id=node_id, address="127.0.0.1", ssl_context=ctx,
                supervisor=node.supervisor,  # type: ignore[arg-type]
                discover=discover_for(lambda: node_inventory(template, node_id, number)),
                reconnect_initial=spec.reconnect_initial, reconnect_max=spec.reconnect_max,
                keepalive=spec.keepalive)

        def make_supervisor(emit: Any) -> SimSupervisor:
            return SimSupervisor(config, emit, self.timings, self.counters, self.engines)

        return SimNode(number, node_id, make_client, make_supervisor, self._session_for(number))

    def _session_for(self, number: int) -> aiohttp.ClientSession:
        per = self.spec.nodes_per_address
        source = source_address(number, per) if per > 0 and loopback_v4(self.spec.url) else None
        session = self.sessions.get(source)
        if session is None:
            local = None if source is None else (source, 0)
            session = self.sessions[source] = stream_session(connector=aiohttp.TCPConnector(limit=0, local_addr=local))
        return session

    # ------------------------------------------------------------------ requests
    async def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        targets = [self.nodes[n] for n in req.get("numbers", ()) if n in self.nodes]
        arg = req.get("arg")
        if op == "stats":
            return self.stats()
        if op == "nodes":
            return {"nodes": [self.node_row(n) for n in self.nodes.values()]}
        if op == "silence":
            for node in targets:
                node.client.silenced = True
        elif op == "heal":
            await self.heal()
        elif op == "kill":
            for node in targets:
                await node.kill()
            if arg is not None:
                self._spawn(self._restart_later(targets, float(arg)))
        elif op == "restart":
            for node in targets:
                await node.restart()
        elif op == "flap":
            for node in targets:
                node.stop_flapping()
                node.flapper = asyncio.get_running_loop().create_task(node.flap(float(arg or 10.0), 1.0))
        elif op == "slow":
            for node in targets:
                node.client.slow_register = float(arg or 0.0)
        elif op in ("malformed", "oversized"):
            for node in targets:
                self._spawn(self._when_registered(node, op))
        elif op == "go":
            await self.go()
        elif op == "close":
            await self.close()
        else:
            return {"error": f"unknown request {op!r}"}
        return {"ok": True, "nodes": [n.node_id for n in targets]}

    def _spawn(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _restart_later(self, nodes: list[SimNode], after: float) -> None:
        await asyncio.sleep(after)
        for node in nodes:
            if node.killed:
                await node.restart()

    async def _when_registered(self, node: SimNode, op: str, wait: float = 120.0) -> None:
        """Send the bad message once the node is registered (a node that never registers sends none)."""
        for _ in range(int(wait / 0.1)):
            if node.client.registered and not node.client.silenced:
                (node.malformed if op == "malformed" else node.oversized)()
                return
            await asyncio.sleep(0.1)

    async def heal(self) -> None:
        for node in self.nodes.values():
            node.stop_flapping()
            node.client.slow_register = 0.0
            if node.client.silenced:
                node.client.heal()
            if node.killed:
                await node.restart()

    # ------------------------------------------------------------------ status
    def node_row(self, node: SimNode) -> dict[str, Any]:
        c = node.client
        return {"node_id": node.node_id, "connected": node.connected, "registered": c.registered,
                "registrations": c.registrations, "connect_errors": c.connect_errors, "lives": node.lives,
                "silenced": c.silenced, "killed": node.killed, "flapping": node.flapper is not None,
                "shards": {s.shard_id: s.state.value for s in node.supervisor.shards.values()
                           if not s.state.terminal}}

    def stats(self) -> dict[str, Any]:
        shards: Counter = Counter({s.value: 0 for s in ShardState})
        hist: Counter = Counter()
        connected = registered = connect_errors = connections = registrations = refusals = 0
        silenced = killed = flapping = slow = held = 0
        for node in self.nodes.values():
            c = node.client
            held += node.lives == 0
            connected += node.connected
            registered += c.registered
            registrations += c.registrations
            hist[c.registrations] += 1
            connections += c.connections
            connect_errors += c.connect_errors
            refusals += c.refusals
            silenced += c.silenced
            killed += node.killed
            flapping += node.flapper is not None
            slow += c.slow_register > 0
            for s in node.supervisor.shards.values():
                shards[s.state.value] += 1
        k = self.counters
        return {"nodes": len(self.nodes), "held": held, "connected": connected, "registered": registered,
                "registrations": registrations, "registrations_per_node": {str(n): v for n, v in sorted(hist.items())},
                "connections": connections, "connect_errors": connect_errors, "refusals": refusals,
                "messages_sent": dict(self.sent), "shards": dict(shards),
                "starts_received": k.starts, "stops_received": k.stops, "drains_received": k.drains,
                "replicas_started": len(k.replicas), "progress_sent": k.progress, "engines_started": k.engines,
                "silenced": silenced, "killed": killed, "flapping": flapping, "slow_register": slow}

    async def close(self) -> None:
        """Stop every real engine (a simulator leaves nothing behind), then drop every connection."""
        for t in list(self._tasks):
            t.cancel()
        stops = [node.supervisor.stop(s.shard_id, "simulator exiting")
                 for node in self.nodes.values() for s in node.supervisor.live_shards()
                 if s.shard_id in node.supervisor.sim_dir.real]
        await asyncio.gather(*stops, return_exceptions=True)
        for node in self.nodes.values():
            node.stop_flapping()
            await node.kill()
            await node.supervisor.detach()
        for session in self.sessions.values():
            await session.close()


# ---------------------------------------------------------------- as a process

async def serve_stdio(spec: WorkerSpec) -> int:
    """Run as a worker process: requests on stdin, one JSON reply line each on stdout."""
    worker = Worker(spec)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 26)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    await worker.start()
    print(json.dumps({"ok": True, "started": len(worker.nodes)}), flush=True)
    try:
        while True:
            line = await reader.readline()
            if not line:
                break
            try:
                req = json.loads(line)
                reply = await worker.handle(req)
            except Exception as e:  # a bad request must not take the worker's agents down
                log.exception("request failed")
                reply = {"error": f"{type(e).__name__}: {e}"}
            print(json.dumps(reply, separators=(",", ":")), flush=True)
            if isinstance(req, dict) and req.get("op") == "close":
                return 0
    finally:
        await worker.close()
    return 0


def setup_logging(level: str) -> None:
    """The simulator's own lines at ``level``; the agent code's per-connection lines only when debugging.

    Ten thousand agents losing their stream at once would otherwise print
    ten thousand warnings, each redial another.
    """
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if logging.getLogger().level > logging.DEBUG:
        for name in ("llmgw.agent", "aiohttp"):
            logging.getLogger(name).setLevel(logging.ERROR)


def run(coro: Any) -> Any:
    """On uvloop (a dependency of the project): it roughly halves the loop's CPU per event."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(coro)
    return uvloop.run(coro)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    spec = WorkerSpec.from_json(Path(args[0]).read_text())
    setup_logging(args[1] if len(args) > 1 else "WARNING")
    return run(serve_stdio(spec))


if __name__ == "__main__":
    sys.exit(main())
