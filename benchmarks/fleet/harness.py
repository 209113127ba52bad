"""One fleet for the scale benchmark: a real control plane and N simulated agents.

- the PKI is real (``llmgw.tls``): the fleet CA, a server certificate for
  127.0.0.1 and an admin certificate; the simulator issues (and caches) one
  node certificate per simulated agent from the same CA;
- ``llmgw server`` runs as its own process (``python -m llmgw server``), so its
  CPU and memory are read from ``/proc/<pid>`` alone, apart from the
  simulator's;
- ``llmgw-fleet-sim`` runs the agents in ``procs`` worker processes, with a
  control socket for faults and a status file;
- the benchmark reads the fleet through the admin API (``/v1/summary`` to
  poll, ``/v1/replicas`` for before/after comparisons), as an operator would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx
import yaml

from llmgw.sim.fleet.client import send_command
from llmgw.sim.fleet.throttle import Throttle
from llmgw.tls import init_ca, issue_admin, issue_server
from llmgw.tls.ca import load_ca
from llmgw.tls.files import write_pair
from tests.support import polling, procfs
from tests.support.fleetclient import admin_client
from tests.support.ports import free_port


# What a fleet of N 8-GPU nodes runs: about 80 % of its GPUs, as shares of
# the fleet's GPUs per profile (two-node replicas need the IB templates).
FILL = (("m16", "x2", 16, 0.04), ("m8", "tp8", 8, 0.30), ("m4", "tp4", 4, 0.20),
        ("m2", "tp2", 2, 0.16), ("m1", "tp1", 1, 0.10))
PROFILES = {"x2": {"tensor_parallel_size": 8, "pipeline_parallel_size": 2, "nodes": 2},
            "tp8": {"tensor_parallel_size": 8}, "tp4": {"tensor_parallel_size": 4},
            "tp2": {"tensor_parallel_size": 2}, "tp1": {"tensor_parallel_size": 1}}


def catalog(nodes: int) -> dict[str, Any]:
    gpus = 8 * nodes
    return {
        "models": [{"name": m, "source": f"org/{m}", "size_bytes": 2 * 10**9 * g} for m, _, g, _ in FILL],
        "profiles": [{"name": p, "engine": "vllm", **PROFILES[p]} for _, p, _, _ in FILL],
        "deployments": [{"model": m, "profile": p, "replicas": max(1, int(gpus * share / g))}
                        for m, p, g, share in FILL],
    }


def declared_inventory(nodes: list[dict[str, Any]], catalog: dict[str, Any]) -> dict[str, Any]:
    """The static declaration an operator keeps for a fleet, from the control plane's ``/v1/nodes``
    and ``/v1/catalog`` answers: every node an agent, the agent version they run, the deployments
    the catalog holds. drift.yml compares it with the live fleet."""
    (version,) = {n["agent_version"] for n in nodes}
    return {"all": {
        "vars": {"llmgw_agent_version": version,
                 "llmgw_deployments": [{k: d[k] for k in ("model", "profile", "replicas")}
                                       for d in catalog["deployments"]]},
        "children": {"llmgw_agents": {"hosts": {n["node_id"]: None for n in nodes}}}}}


def until(pred: Callable[[], Any], what: str, timeout: float, interval: float = 1.0) -> Any:
    """``tests.support.polling.until`` raising TimeoutError: a fleet that never converged is a
    benchmark's result (run.py reports it), not a test failure."""
    return polling.until(pred, what, timeout, interval=interval, error=TimeoutError)


@dataclass
class Fleet:
    root: Path
    nodes: int
    procs: int = 2
    lifecycle: dict[str, Any] = field(default_factory=dict)
    cert_cache: Path | None = None
    sim_args: tuple[str, ...] = ()
    port: int = 0
    server: subprocess.Popen | None = None
    sim: subprocess.Popen | None = None
    started_at: float = 0.0
    cpu_share: float | None = None  # hold the control plane to this share of one CPU (contention)
    throttle: Throttle | None = None

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        pki = self.root / "pki"
        # The CA outlives a run, so the simulator's cached node certificates stay valid.
        cache = self.cert_cache or (Path.home() / ".cache/llmgw/fleet-bench")
        self.cert_cache = cache
        self.ca = load_ca(cache / "ca") if (cache / "ca" / "ca.key").exists() else init_ca(cache / "ca")
        self.server_pair = write_pair(pki / "server", *issue_server(self.ca, ["localhost"], ["127.0.0.1"]))
        self.admin_pair = write_pair(pki / "admin", *issue_admin(self.ca, "bench"))
        self.port = self.port or free_port()
        self.status_path = self.root / "sim-status.json"
        self.control_path = self.root / "sim.sock"
        self.write_config()
        self._http: httpx.Client | None = None

    # ------------------------------------------------------------- config
    def write_config(self, **lifecycle: Any) -> Path:
        cfg = {"api": {"listen": {"host": "127.0.0.1", "port": self.port}},
               "tls": {"ca": str(self.ca.cert_path), "cert": str(self.server_pair[0]),
                       "key": str(self.server_pair[1])},
               "lifecycle": {**self.lifecycle, **lifecycle},
               "state_dir": str(self.root / "cp-state"),  # grant.key: restarts adopt, not replace
               **catalog(self.nodes)}
        path = self.root / "server.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return path

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    # ------------------------------------------------------------ processes
    def start_server(self) -> None:
        log = open(self.root / "server.log", "ab")
        self.server = subprocess.Popen([sys.executable, "-m", "llmgw", "--log-level", os.environ.get("FLEET_CP_LOG", "INFO"), "server", "--config",
                                        str(self.root / "server.yaml")], stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        self.started_at = time.monotonic()
        until(lambda: self._healthy(), "the control plane's /healthz", 60, 0.2)
        if self.cpu_share is not None:
            self.throttle = Throttle(self.server.pid, self.cpu_share).start()

    def _unthrottle(self) -> None:
        if self.throttle is not None:
            self.throttle.stop()
            self.throttle = None

    def kill_server(self) -> None:
        assert self.server is not None
        self._unthrottle()
        self.server.send_signal(signal.SIGKILL)
        self.server.wait()
        self.close_http()

    def start_sim(self) -> None:
        cache = self.cert_cache
        log = open(self.root / "sim.log", "ab")
        self.sim = subprocess.Popen(
            [str(Path(sys.executable).parent / "llmgw-fleet-sim"), "--url", f"wss://127.0.0.1:{self.port}/v1/agent/stream",
             "--ca-dir", str(self.ca.directory), "--cert-cache", str(cache), "--nodes", str(self.nodes),
             "--procs", str(self.procs), "--status-file", str(self.status_path), "--control", str(self.control_path),
             "--seed", "7", "--log-level", os.environ.get("FLEET_SIM_LOG", "WARNING"), *self.sim_args],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        until(lambda: self.control_path.exists() or self.sim.poll() is not None, "the simulator's control socket", 600)
        if self.sim.poll() is not None:
            raise RuntimeError(f"fleet simulator exited {self.sim.returncode}; see {self.root / 'sim.log'}")

    def stop(self) -> None:
        self._unthrottle()
        for p in (self.sim, self.server):
            if p is not None and p.poll() is None:
                with _quiet():
                    os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        self.close_http()

    def sim_command(self, line: str) -> dict[str, Any]:
        return send_command(str(self.control_path), line, timeout=300)

    def sim_cpu(self) -> float:
        """The simulator's CPU: its coordinator and every worker process."""
        status = self.sim_status()
        total = sum(p.get("cpu_seconds", 0.0) for p in status.get("procs", []))
        return total

    def sim_status(self) -> dict[str, Any]:
        try:
            return json.loads(self.status_path.read_text())
        except (OSError, ValueError):
            return {}

    # ------------------------------------------------------------ admin API
    def http(self) -> httpx.Client:
        if self._http is None:
            self._http = admin_client(self.url, self.ca.cert_path, self.admin_pair, timeout=120)
        return self._http

    def close_http(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None

    def _healthy(self) -> bool:
        try:
            return self.http().get("/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def get(self, path: str) -> Any:
        r = self.http().get(path)
        r.raise_for_status()
        return r.json()

    def summary(self) -> dict[str, Any]:
        return self.get("/v1/summary")

    def converged(self, s: dict[str, Any] | None = None) -> bool:
        """Every node registered and connected, every desired replica Ready, nothing claimed twice."""
        s = s or self.summary()
        return (s["nodes"]["total"] == self.nodes and s["nodes"]["connected"] == self.nodes
                and s["nodes"]["by_state"].get("ready", 0) == self.nodes
                and s["replicas"]["by_state"].get("ready", 0) == s["replicas"]["desired"]
                and s["replicas"]["total"] == s["replicas"]["desired"] and s["gpus"]["claimed_twice"] == 0)

    def placements(self) -> dict[str, tuple]:
        """replica id -> ((node, gpus), ...) of every replica, for before/after comparisons."""
        return {r["replica_id"]: tuple((s["node_id"], tuple(s["gpus"])) for s in r["shards"])
                for r in self.get("/v1/replicas")["replicas"]}

    # -------------------------------------------------------- measurements
    def server_cpu(self) -> float:
        assert self.server is not None
        return procfs.cpu_seconds(self.server.pid)

    def server_rss(self) -> int:
        assert self.server is not None
        return procfs.rss_bytes(self.server.pid)


class _quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> bool:
        return exc[0] is not None and issubclass(exc[0], (ProcessLookupError, PermissionError))
