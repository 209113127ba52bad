"""A real etcd (Debian's etcd-server) on loopback for a test: free ports, a temporary data dir.

Tests that need it start one with ``Etcd(tmp_path)``;
``etcd_or_skip()`` skips with a reason only when the binary is absent
(``make etcd`` installs it).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from fleet import Proc, free_port, until


def etcd_or_skip() -> str:
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("etcd is not installed (make etcd: Debian's etcd-server)")
    return binary


class Etcd:
    """One single-member etcd cluster; ``url`` is its client endpoint."""

    def __init__(self, root: Path, name: str = "etcd"):
        binary = etcd_or_skip()
        root.mkdir(parents=True, exist_ok=True)
        client, peer = free_port(), free_port()
        self.url = f"http://127.0.0.1:{client}"
        self.proc = Proc(name, [
            binary, "--name", name, "--data-dir", str(root / "data"),
            "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"{name}=http://127.0.0.1:{peer}",
            "--listen-metrics-urls", f"http://127.0.0.1:{free_port()}",
        ], root / "etcd.log", root)

    def start(self) -> "Etcd":
        self.proc.start()
        until(self.healthy, "etcd to answer", on_timeout=self.proc.output)
        return self

    def healthy(self) -> bool:
        try:
            return httpx.post(f"{self.url}/v3/maintenance/status", json={}, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        self.proc.terminate()

    def __enter__(self) -> "Etcd":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
