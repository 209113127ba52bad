"""Real network partitions for a fleet on one machine: each agent in its own network namespace.

    with Network(["a", "b"]) as net:          # root only; see ``unavailable()``
        f = netns_fleet(tmp_path, net, {"a": 1, "b": 1})
        net.cut("a")                           # both directions, silently dropped
        net.cut("a", direction="from_cp")      # control plane -> agent dropped, agent -> cp passes
        net.heal("a")

A bridge in the root namespace carries ``10.X.Y.1/24`` (the control plane
and its router listen there); node ``i`` sits in namespace ``llmgw-…-<name>``
at ``10.X.Y.(i+2)`` behind a veth pair on that bridge, so its agent and the
engines it launches reach the control plane, and the router reaches the
engines, over a real (virtual) link.  A cut is a pair of blackhole routes
(``ip route add blackhole``): packets are dropped without an error or a
reset, as on a partitioned network, and one route alone cuts one direction.
It needs only ``ip`` (iproute2) and root; netfilter and ``tc netem`` are not
used, so it also works where those kernel modules cannot be loaded.

A link is impaired with ``tc netem`` where the kernel has ``sch_netem``.
Where it has not, ``lose`` drops a share of the node's packets at random in
its namespace with nftables (real loss, which TCP must recover from), and
``DelayRelay`` holds every chunk of a TCP stream for a fixed time in each
direction (latency on the connections routed through it).
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from fleet import Fleet, edit_agent_config, make_pki


def unavailable() -> str | None:
    """Why partitions cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"llmgw-probe-{os.getpid()}"
    res = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if res.returncode != 0:
        return f"cannot create a network namespace: {res.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def netem_unavailable() -> str | None:
    """Why ``tc ... netem`` cannot impair a link here (None when it can), tried on a throwaway veth pair."""
    why = unavailable()
    if why is not None:
        return why
    if shutil.which("tc") is None:
        return "iproute2's `tc` is not installed"
    veth = f"lgq{os.getpid() % 100000}"
    try:
        ip("link", "add", veth, "type", "veth", "peer", "name", veth + "p")
    except RuntimeError as e:
        return str(e)
    try:
        res = subprocess.run(["tc", "qdisc", "add", "dev", veth, "root", "netem", "delay", "1ms"],
                             capture_output=True, text=True)
        if res.returncode != 0:
            return f"tc ... netem: {res.stderr.strip()} (the kernel's sch_netem module is needed)"
        return None
    finally:
        subprocess.run(["ip", "link", "del", veth], capture_output=True)


def ip(*args: str, ns: str | None = None) -> None:
    argv = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    res = subprocess.run(argv, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {res.stderr.strip()}")


class Network:
    def __init__(self, names: list[str]):
        tag = f"{os.getpid() % 10000:04d}{random.randrange(100):02d}"
        self.prefix = f"10.{random.randrange(100, 250)}.{random.randrange(0, 255)}"
        self.host = f"{self.prefix}.1"
        self.bridge = f"lgb{tag}"
        self.ns = {n: f"llmgw-{tag}-{n}" for n in names}
        self.addr = {n: f"{self.prefix}.{i + 2}" for i, n in enumerate(names)}
        self._veth = {n: f"lgv{tag}{i}" for i, n in enumerate(names)}
        self._cuts: dict[str, set[str]] = {n: set() for n in names}

    def __enter__(self) -> "Network":
        try:
            ip("link", "add", self.bridge, "type", "bridge")
            ip("addr", "add", f"{self.host}/24", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for n, ns in self.ns.items():
                ip("netns", "add", ns)
                host_end, node_end = self._veth[n], self._veth[n] + "n"
                ip("link", "add", host_end, "type", "veth", "peer", "name", node_end)
                ip("link", "set", node_end, "netns", ns)
                ip("link", "set", host_end, "master", self.bridge)
                ip("link", "set", host_end, "up")
                ip("addr", "add", f"{self.addr[n]}/24", "dev", node_end, ns=ns)
                ip("link", "set", node_end, "up", ns=ns)
                ip("link", "set", "lo", "up", ns=ns)
        except Exception:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for n, ns in self.ns.items():
            subprocess.run(["ip", "route", "del", "blackhole", f"{self.addr[n]}/32"], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # takes its veth end along
            subprocess.run(["ip", "link", "del", self._veth[n]], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def wrap(self, name: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns[name], *argv]

    def cut(self, name: str, direction: str = "both") -> None:
        """Drop traffic between node ``name`` and the host: ``both``, ``to_cp`` or ``from_cp`` only."""
        if direction in ("both", "to_cp") and "to_cp" not in self._cuts[name]:
            ip("route", "add", "blackhole", f"{self.host}/32", ns=self.ns[name])
            self._cuts[name].add("to_cp")
        if direction in ("both", "from_cp") and "from_cp" not in self._cuts[name]:
            ip("route", "add", "blackhole", f"{self.addr[name]}/32")
            self._cuts[name].add("from_cp")

    def impair(self, name: str, *netem: str) -> str | None:
        """``tc qdisc ... netem ARGS`` on both ends of node ``name``'s link; the reason when tc cannot."""
        for argv in (["tc", "qdisc", "add", "dev", self._veth[name], "root", "netem", *netem],
                     ["ip", "netns", "exec", self.ns[name], "tc", "qdisc", "add", "dev", self._veth[name] + "n",
                      "root", "netem", *netem]):
            if shutil.which("tc") is None:
                return "iproute2's `tc` is not installed"
            res = subprocess.run(argv, capture_output=True, text=True)
            if res.returncode != 0:
                return f"{' '.join(argv)}: {res.stderr.strip()} (the kernel's sch_netem module is needed)"
        return None

    def lose(self, name: str, percent: int) -> str | None:
        """Drop ``percent`` % of node ``name``'s packets each way at random (nftables in its
        namespace); the reason when nftables cannot."""
        if shutil.which("nft") is None:
            return "nftables' `nft` is not installed"
        rules = (f"add table inet llmgw_loss\n"
                 f"add chain inet llmgw_loss out {{ type filter hook output priority 0; }}\n"
                 f"add chain inet llmgw_loss in {{ type filter hook input priority 0; }}\n"
                 f"add rule inet llmgw_loss out ip daddr {self.host} numgen random mod 100 < {percent} drop\n"
                 f"add rule inet llmgw_loss in ip saddr {self.host} numgen random mod 100 < {percent} drop\n")
        res = subprocess.run(["ip", "netns", "exec", self.ns[name], "nft", "-f", "-"], input=rules,
                             capture_output=True, text=True)
        return None if res.returncode == 0 else f"nft: {res.stderr.strip()}"

    def heal(self, name: str) -> None:
        if "to_cp" in self._cuts[name]:
            ip("route", "del", "blackhole", f"{self.host}/32", ns=self.ns[name])
        if "from_cp" in self._cuts[name]:
            ip("route", "del", "blackhole", f"{self.addr[name]}/32")
        self._cuts[name].clear()


def netns_fleet(root: Path, net: Network, nodes: dict[str, int], **kw: Any) -> Fleet:
    """A Fleet whose control plane listens on the bridge and whose agents run in their namespaces."""
    pki = make_pki(root / "pki", ips=("127.0.0.1", net.host))
    f = Fleet(root, nodes=nodes, pki=pki, api_host=net.host, stream_host=net.host, **kw)
    f.config["api"]["listen"]["host"] = net.host
    if f.router_port is not None:
        f.config["router"]["listen"]["host"] = net.host
    f.write_config()
    for name, agent in f.agents.items():
        addr = net.addr[name]

        def change(doc: dict[str, Any], addr: str = addr) -> None:
            doc["advertise_address"] = addr
            doc["engine_bind_host"] = addr
        edit_agent_config(agent, change)
        agent.argv = net.wrap(name, agent.argv)
    return f


class DelayRelay:
    """A TCP relay that holds every chunk ``delay`` seconds in each direction, in order.

    Latency without ``sch_netem``: connections routed through it (a client told
    to dial ``address``) see ``2 * delay`` more round trip, and nothing else
    changes (no reordering, no rate limit). Runs its own loop in a thread.
    """

    def __init__(self, host: str, upstream: tuple[str, int], delay: float):
        self.upstream, self.delay = upstream, delay
        sock = socket.socket()
        sock.bind((host, 0))
        self.address = sock.getsockname()
        self._sock = sock
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.connections = 0

    def __enter__(self) -> "DelayRelay":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _shutdown(self) -> None:
        self._server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _serve(self) -> None:
        self._server = await asyncio.start_server(self._relay, sock=self._sock)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer), return_exceptions=True)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, chunk = await queue.get()
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not chunk:
                    writer.close()
                    return
                writer.write(chunk)
                await writer.drain()

        sender = asyncio.ensure_future(deliver())
        try:
            while True:
                chunk = await reader.read(65536)
                queue.put_nowait((time.monotonic() + self.delay, chunk))
                if not chunk:
                    break
            await sender
        except (OSError, asyncio.CancelledError):
            sender.cancel()
            writer.close()
