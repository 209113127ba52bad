"""The simulator's top: its workers, its status file, its control channels.

With ``--procs 1`` the one worker runs in this process; with more, each is a
``python -m llmgw.sim.fleet.worker`` process spoken to over its stdin and
stdout, one JSON request and one JSON reply per line.  Either way the
coordinator draws the nodes a command applies to from the whole fleet,
hands each worker its own, and sums the workers' counts into one status.

The status goes to ``--status-file`` every ``--status-interval`` seconds,
atomically (a reader never sees half a document), and to anyone who asks
``stats`` on stdin or on the ``--control`` unix socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import stat
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Protocol

from llmgw.agent import procident
from llmgw.sim.fleet.control import USAGE, Command, CommandError, parse_command, select
from llmgw.sim.fleet.worker import Worker, WorkerSpec
from llmgw.durable import PUBLIC_MODE, write_atomic

log = logging.getLogger(__name__)

CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_usage(pid: int) -> tuple[float, int]:
    """(CPU seconds, resident KiB) of ``pid`` from /proc; (0, 0) once it is gone."""
    st = procident.read_stat(pid)
    if st is None:
        return 0.0, 0
    cpu = st.cpu_ticks / CLK_TCK
    try:
        rss_kb = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if line.startswith("VmRSS:"))
        return cpu, rss_kb
    except (OSError, ValueError, StopIteration):
        return 0.0, 0


def merge(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """Sum workers' stats: numbers add up, nested counts add up key by key."""
    out: dict[str, Any] = {}
    for d in docs:
        for k, v in d.items():
            if isinstance(v, dict):
                c = Counter(out.get(k, {}))
                c.update(v)
                out[k] = dict(c)
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = out.get(k, 0) + v
    return out


class Handle(Protocol):
    numbers: set[int]
    pid: int

    async def request(self, req: dict[str, Any]) -> dict[str, Any]: ...

    async def close(self) -> None: ...


class LocalHandle:
    def __init__(self, spec: WorkerSpec):
        self.numbers = set(spec.numbers)
        self.worker = Worker(spec)
        self.pid = os.getpid()

    async def start(self) -> None:
        await self.worker.start()

    async def request(self, req: dict[str, Any]) -> dict[str, Any]:
        return await self.worker.handle(req)

    async def close(self) -> None:
        await self.worker.close()


class ProcessHandle:
    def __init__(self, spec: WorkerSpec, log_level: str):
        self.numbers = set(spec.numbers)
        fd, self.spec_path = tempfile.mkstemp(prefix="llmgw-fleet-worker-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(spec.to_json())
        self.log_level = log_level
        self.proc: asyncio.subprocess.Process | None = None
        self.lock = asyncio.Lock()
        self.pid = 0

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "llmgw.sim.fleet.worker", self.spec_path, self.log_level,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=1 << 26)
        self.pid = self.proc.pid
        first = await self._read()
        os.unlink(self.spec_path)
        if not first.get("ok"):
            raise RuntimeError(f"worker {self.pid} did not start: {first}")

    async def _read(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        line = await self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker process {self.pid} exited (status {await self.proc.wait()})")
        return json.loads(line)

    async def request(self, req: dict[str, Any]) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        async with self.lock:
            try:
                self.proc.stdin.write(json.dumps(req).encode() + b"\n")
                await self.proc.stdin.drain()
            except (ConnectionError, RuntimeError):
                raise RuntimeError(f"worker process {self.pid} exited (status {await self.proc.wait()})") from None
            return await self._read()

    async def close(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.request({"op": "close"}), timeout=30)
        with contextlib.suppress(Exception):
            self.proc.stdin.close()  # type: ignore[union-attr]
        try:
            await asyncio.wait_for(self.proc.wait(), timeout=30)
        except asyncio.TimeoutError:
            self.proc.kill()
            await self.proc.wait()


class Coordinator:
    def __init__(self, handles: list[Handle], node_ids: list[str], seed: int | None, meta: dict[str, Any]):
        self.handles = handles
        self.node_ids = node_ids
        self.total = len(node_ids)
        self.rng = random.Random(seed)
        self.meta = meta
        self.started = time.time()
        self.done = asyncio.Event()
        self.last_status: dict[str, Any] = {}
        self.failed: str | None = None

    async def status(self) -> dict[str, Any]:
        try:
            docs = await asyncio.gather(*(h.request({"op": "stats"}) for h in self.handles))
        except RuntimeError as e:  # a worker process died: its agents are gone, the figures would lie
            log.error("%s; stopping", e)
            self.failed = str(e)
            self.done.set()
            raise
        doc = merge(docs)
        procs = []
        for h in self.handles:
            cpu, rss = proc_usage(h.pid)
            procs.append({"pid": h.pid, "cpu_seconds": round(cpu, 2), "rss_kib": rss})
        rss_total = sum(p["rss_kib"] for p in {p["pid"]: p for p in procs}.values())
        if all(h.pid != os.getpid() for h in self.handles):
            cpu, rss = proc_usage(os.getpid())
            procs.append({"pid": os.getpid(), "cpu_seconds": round(cpu, 2), "rss_kib": rss, "coordinator": True})
            rss_total += rss
        doc.update({"time": time.time(), "uptime": round(time.time() - self.started, 3), "procs": procs,
                    "rss_kib": rss_total,
                    "rss_kib_per_node": round(rss_total / self.total, 2) if self.total else None, **self.meta})
        self.last_status = doc
        return doc

    async def execute(self, cmd: Command) -> dict[str, Any]:
        if cmd.op == "stats":
            return await self.status()
        if cmd.op == "help":
            return {"ok": True, "help": USAGE}
        if cmd.op == "quit":
            self.done.set()
            return {"ok": True}
        if cmd.op == "nodes":
            rows = []
            for doc in await asyncio.gather(*(h.request({"op": "nodes"}) for h in self.handles)):
                rows += doc["nodes"]
            return {"nodes": sorted(rows, key=lambda r: r["node_id"])}
        numbers = select(self.rng, self.node_ids, cmd.share) if cmd.share is not None else []
        replies = await asyncio.gather(*(
            h.request({"op": cmd.op, "numbers": sorted(h.numbers.intersection(numbers)), "arg": cmd.arg})
            for h in self.handles))
        errors = [r["error"] for r in replies if "error" in r]
        if errors:
            return {"error": "; ".join(errors)}
        return {"ok": True, "op": cmd.op, "nodes": sorted(n for r in replies for n in r.get("nodes", ()))}

    async def line(self, text: str) -> str:
        try:
            reply = await self.execute(parse_command(text))  # select() may raise CommandError too
        except CommandError as e:
            reply = {"error": str(e)}
        return json.dumps(reply, separators=(",", ":"))

    # ------------------------------------------------------------ channels
    async def write_status(self, path: Path, interval: float) -> None:
        while True:
            try:
                doc = await self.status()
                write_atomic(path, json.dumps(doc, indent=1).encode() + b"\n", mode=PUBLIC_MODE)
            except RuntimeError:
                return  # a worker died; status() said so and stops the simulator
            except Exception:
                log.exception("cannot write the status to %s", path)
            await asyncio.sleep(interval)

    async def serve_stdin(self) -> None:
        """Commands on stdin when it is a pipe, socket or terminal (not /dev/null or a file)."""
        try:
            mode = os.fstat(sys.stdin.fileno()).st_mode
        except (OSError, ValueError):
            return
        if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or sys.stdin.isatty()):
            return
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while True:
            raw = await reader.readline()
            if not raw:
                return  # stdin closed: keep running (a benchmark may use the socket)
            if raw.strip():
                print(await self.line(raw.decode(errors="replace")), flush=True)

    async def serve_socket(self, path: Path) -> asyncio.AbstractServer:
        async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while raw := await reader.readline():
                    if raw.strip():
                        writer.write((await self.line(raw.decode(errors="replace"))).encode() + b"\n")
                        await writer.drain()
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()

        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        server = await asyncio.start_unix_server(client, path=str(path), limit=1 << 20)
        os.chmod(path, 0o600)  # the control socket can kill the fleet: owner only
        return server
