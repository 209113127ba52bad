"""A real etcd (Debian's etcd-server) on loopback for a test: free ports, temporary data dirs.

Tests that need one member start it with ``Etcd(tmp_path)``; a three-member
cluster (static ``--initial-cluster``, one data dir per member) with
``EtcdCluster(tmp_path)``, whose ``leader()`` says which member raft elected
so a test can kill that one.  ``CutRelay`` stands between a client and one
member and can be cut: a partition that swallows bytes, not one that
refuses connections.  ``etcd_or_skip()`` skips with a reason only when the
binary is absent (``make etcd`` installs it).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from pathlib import Path

import httpx
import pytest

from fleet import Proc, free_port, until
from netns import DelayRelay


def etcd_or_skip() -> str:
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("etcd is not installed (make etcd: Debian's etcd-server)")
    return binary


def status(url: str) -> dict | None:
    """The member's ``/v3/maintenance/status`` (its id, the raft leader's id), or None if it does not answer."""
    try:
        r = httpx.post(f"{url}/v3/maintenance/status", json={}, timeout=1)
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 else None


class Member:
    """One etcd member: its name, client URL and process."""

    def __init__(self, binary: str, root: Path, name: str, client: int, peer: int, cluster: str):
        root.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.url = f"http://127.0.0.1:{client}"
        self.proc = Proc(name, [
            binary, "--name", name, "--data-dir", str(root / "data"),
            "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", cluster, "--initial-cluster-token", cluster,
            "--listen-metrics-urls", f"http://127.0.0.1:{free_port()}",
        ], root / "etcd.log", root)

    def status(self) -> dict | None:
        return status(self.url) if self.proc.alive() else None


class EtcdCluster:
    """``size`` members on loopback, started together; ``urls`` are their client endpoints."""

    def __init__(self, root: Path, size: int = 3, prefix: str = "etcd"):
        binary = etcd_or_skip()
        names = [f"{prefix}{i}" for i in range(size)]
        ports = [(free_port(), free_port()) for _ in names]
        cluster = ",".join(f"{n}=http://127.0.0.1:{peer}" for n, (_, peer) in zip(names, ports))
        self.members = [Member(binary, root / n, n, client, peer, cluster)
                        for n, (client, peer) in zip(names, ports)]

    @property
    def urls(self) -> list[str]:
        return [m.url for m in self.members]

    @property
    def url(self) -> str:
        return self.members[0].url

    def start(self) -> "EtcdCluster":
        for m in self.members:
            m.proc.start()
        until(lambda: self.leader() is not None, f"{len(self.members)} etcd members to elect a leader",
              on_timeout=lambda: "\n".join(m.proc.output(3000) for m in self.members))
        return self

    def leader(self) -> Member | None:
        """The member raft elected, as every member that answers agrees; None while they do not."""
        answers = [(m, m.status()) for m in self.members if m.proc.alive()]
        if not answers or any(s is None for _, s in answers):
            return None
        leaders = {s.get("leader") for _, s in answers}  # absent while a member knows no leader
        if len(leaders) != 1 or None in leaders:
            return None
        (leader,) = leaders
        return next((m for m, s in answers if s["header"]["member_id"] == leader), None)

    def stop(self) -> None:
        for m in self.members:
            m.proc.terminate()

    def __enter__(self) -> "EtcdCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Etcd(EtcdCluster):
    """One single-member etcd cluster; ``url`` is its client endpoint."""

    def __init__(self, root: Path, name: str = "etcd"):
        binary = etcd_or_skip()
        client, peer = free_port(), free_port()
        self.members = [Member(binary, root, name, client, peer, f"{name}=http://127.0.0.1:{peer}")]
        self.proc = self.members[0].proc

    def healthy(self) -> bool:
        return status(self.url) is not None

    def __enter__(self) -> "Etcd":
        self.start()
        return self


class CutRelay(DelayRelay):
    """A TCP relay to one member that can be cut: it then still accepts and reads, and passes nothing on.

    A cut host's packets are dropped, not refused: a client sees a connection
    that never answers, and only its own timeouts get it out.
    """

    def __init__(self, upstream_url: str):
        host, port = upstream_url.rsplit("/", 1)[-1].rsplit(":", 1)
        super().__init__("127.0.0.1", (host, int(port)), 0.0)
        self.is_cut = False
        self.url = f"http://127.0.0.1:{self.address[1]}"

    def cut(self) -> None:
        self.is_cut = True

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.CancelledError):  # cancelled when the relay closes
            await super()._relay(reader, writer)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while chunk := await reader.read(65536):
                if not self.is_cut:
                    writer.write(chunk)
                    await writer.drain()
        except (OSError, asyncio.CancelledError):
            pass
        if not self.is_cut:
            writer.close()
