"""The fleet simulator as a real process against a real control plane (no tests here), and what a
test reads of the fleet it runs: the nodes document, the placement, no GPU held twice."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from fleet import Fleet, Proc, gpu_owners
from llmgw.sim.fleet.client import send_command


NODES = 200


REAL = 2  # replicas of model "real", served by real engine simulators (--engines)


class Sim:
    """The simulator process, its status file and its control socket."""

    def __init__(self, f: Fleet, root: Path, nodes: int = NODES, engines: int = REAL, extra: tuple[str, ...] = ()):
        self.sock_dir = Path(tempfile.mkdtemp(prefix="fsim-"))  # unix socket paths must be short
        self.sock = self.sock_dir / "ctl.sock"
        self.status_path = root / "sim-status.json"
        argv = [sys.executable, "-m", "llmgw.sim.fleet.cli", "--url", f.stream_url,
                "--ca-dir", str(f.pki.ca.directory), "--cert-cache", str(root / "sim-certs"),
                "--nodes", str(nodes), "--prefix", f"fs{f.suffix.replace('-', '')}", "--seed", "7",
                "--start-seconds", "0.3", "--fetch-seconds", "0.3", "--progress-interval", "0.1",
                "--stop-seconds", "0.1", "--reconnect-initial", "0.2", "--reconnect-max", "1.0",
                "--status-file", str(self.status_path), "--status-interval", "0.5",
                "--control", str(self.sock), "--log-level", "INFO", *extra]
        if engines:
            argv += ["--engines", str(engines), "--engine-models", "real", "--engine-command", str(f.sim),
                     "--engine-dir", str(root / "sim-engines")]
        self.prefix = argv[argv.index("--prefix") + 1]
        self.proc = Proc("fleet-sim", argv, root / "fleet-sim.log", root)

    def command(self, line: str) -> dict[str, Any]:
        reply = send_command(str(self.sock), line)
        assert "error" not in reply, reply
        return reply

    def status(self) -> dict[str, Any] | None:
        return read_json(self.status_path)

    def close(self) -> None:
        self.proc.terminate()
        shutil.rmtree(self.sock_dir, ignore_errors=True)


def nodes_doc(f: Fleet) -> dict[str, Any] | None:
    return f.try_get("/v1/nodes")


def placement(doc: dict[str, Any]) -> dict[str, tuple]:
    """replica id -> every shard's (id, node, GPUs, process identity): what a restart or move would change."""
    return {r["replica_id"]: tuple((s["shard_id"], s["node_id"], tuple(s["gpus"]),
                                    json.dumps(s["process"], sort_keys=True)) for s in r["shards"])
            for r in doc["replicas"]}


def assert_no_gpu_twice(doc: dict[str, Any]) -> None:
    twice = {k: v for k, v in gpu_owners(doc).items() if len(v) > 1}
    assert not twice, f"GPUs assigned twice: {twice}"


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
