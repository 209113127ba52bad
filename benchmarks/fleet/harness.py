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
  poll, ``/v1/replicas`` for before/after comparisons), as an operator would;
- with ``ha`` (the failover phase) a one-member etcd (Debian's etcd-server)
  and a second ``llmgw server`` stand beside it: the agents know both
  addresses and follow whichever leads.
"""

from __future__ import annotations

import json
import os
import shutil
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
    ha: dict[str, Any] | None = None  # etcd election settings (lease_ttl, renew_interval): a standby beside
    standby: subprocess.Popen | None = None
    standby_port: int = 0
    etcd: "EtcdServer | None" = None
    # api.clients.max_connections_per_source; None: the product's default. Every simulated agent
    # dials from 127.0.0.1, where a fleet's nodes each have their own address.
    per_source_cap: int | None = None

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
        if self.ha is not None:
            self.standby_port = free_port()
            self.etcd = EtcdServer(self.root / "etcd")
        self.status_path = self.root / "sim-status.json"
        self.control_path = self.root / "sim.sock"
        self.write_config()
        self._http: httpx.Client | None = None

    # ------------------------------------------------------------- config
    def write_config(self, **lifecycle: Any) -> Path:
        path = self.root / "server.yaml"
        path.write_text(yaml.safe_dump(self._config(self.port, "cp1", lifecycle), sort_keys=False))
        if self.ha is not None:
            (self.root / "standby.yaml").write_text(yaml.safe_dump(self._config(self.standby_port, "cp2", lifecycle),
                                                                   sort_keys=False))
        return path

    def _config(self, port: int, name: str, lifecycle: dict[str, Any]) -> dict[str, Any]:
        cfg = {"api": {"listen": {"host": "127.0.0.1", "port": port},
                       **({"clients": {"max_connections_per_source": self.per_source_cap}}
                          if self.per_source_cap is not None else {})},
               "tls": {"ca": str(self.ca.cert_path), "cert": str(self.server_pair[0]),
                       "key": str(self.server_pair[1])},
               "lifecycle": {**self.lifecycle, **lifecycle},
               "state_dir": str(self.root / f"{name}-state" if self.ha else self.root / "cp-state"),
               **catalog(self.nodes)}
        if self.ha is not None and self.etcd is not None:
            cfg["ha"] = {"etcd": {"endpoints": [self.etcd.url]}, "name": name,
                         "advertise_url": f"https://127.0.0.1:{port}", **self.ha}
        return cfg

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    # ------------------------------------------------------------ processes
    def _server_proc(self, config: str, log_name: str) -> subprocess.Popen:
        if self.etcd is not None and not self.etcd.running():
            self.etcd.start()
        log = open(self.root / log_name, "ab")
        return subprocess.Popen([sys.executable, "-m", "llmgw", "--log-level", os.environ.get("FLEET_CP_LOG", "INFO"),
                                 "server", "--config", str(self.root / config)], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)

    def start_server(self) -> None:
        self.server = self._server_proc("server.yaml", "server.log")
        self.started_at = time.monotonic()
        until(lambda: self._healthy(), "the control plane's /healthz", 60, 0.2)
        if self.ha is not None:
            until(lambda: self.role(self.port) == "leader", "the control plane to lead", 60, 0.2)
        if self.cpu_share is not None:
            self.throttle = Throttle(self.server.pid, self.cpu_share).start()

    def start_standby(self) -> None:
        """The second control plane (``ha`` only): it stands by while the first leads."""
        self.standby = self._server_proc("standby.yaml", "standby.log")
        until(lambda: self.role(self.standby_port) == "standby", "the second control plane to stand by", 60, 0.2)

    def role(self, port: int) -> str | None:
        """"leader" or "standby" by the control plane's answer on ``port``; None when it does not answer."""
        try:
            with admin_client(f"https://127.0.0.1:{port}", self.ca.cert_path, self.admin_pair, timeout=3) as c:
                r = c.get("/v1/summary")
        except httpx.HTTPError:
            return None
        return r.headers.get("X-Llmgw-Role", "leader") if r.status_code == 200 else None

    def promote_standby(self) -> None:
        """The standby leads now: the admin API and the measurements follow it."""
        assert self.standby is not None
        self.server, self.standby = self.standby, None
        self.port, self.standby_port = self.standby_port, 0
        self.close_http()

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

    def start_sim(self, hold: bool = False) -> None:
        """The simulator, its agents dialling; with ``hold`` built but waiting for ``go``."""
        cache = self.cert_cache
        log = open(self.root / "sim.log", "ab")
        self.sim = subprocess.Popen(
            [str(Path(sys.executable).parent / "llmgw-fleet-sim"), "--url", f"wss://127.0.0.1:{self.port}/v1/agent/stream",
             *(["--url", f"wss://127.0.0.1:{self.standby_port}/v1/agent/stream"] if self.standby_port else []),
             "--ca-dir", str(self.ca.directory), "--cert-cache", str(cache), "--nodes", str(self.nodes),
             "--procs", str(self.procs), "--status-file", str(self.status_path), "--control", str(self.control_path),
             "--seed", "7", "--log-level", os.environ.get("FLEET_SIM_LOG", "WARNING"), *(["--hold"] if hold else []),
             *self.sim_args],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        until(lambda: self.control_path.exists() or self.sim.poll() is not None, "the simulator's control socket", 600)
        if self.sim.poll() is not None:
            raise RuntimeError(f"fleet simulator exited {self.sim.returncode}; see {self.root / 'sim.log'}")

    def go(self) -> None:
        """The agents of a simulator started with ``hold`` make their first dial."""
        reply = self.sim_command("go")
        if "error" in reply:
            raise RuntimeError(f"fleet simulator: go: {reply['error']}")

    def stop(self) -> None:
        self._unthrottle()
        for p in (self.sim, self.server, self.standby):
            if p is not None and p.poll() is None:
                with _quiet():
                    os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        if self.etcd is not None:
            self.etcd.stop()
        self.close_http()

    def sim_command(self, line: str) -> dict[str, Any]:
        return send_command(str(self.control_path), line, timeout=300)

    def sim_cpu(self, fresh: bool = False) -> float:
        """The simulator's CPU: its coordinator and every worker process (``fresh``: asked now, not
        read from the status file it writes every second)."""
        status = self.sim_command("stats") if fresh else self.sim_status()
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


class EtcdServer:
    """One etcd member on loopback (Debian's etcd-server) for the control planes' election."""

    def __init__(self, root: Path):
        self.root = root
        self.client, self.peer = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.client}"
        self.proc: subprocess.Popen | None = None

    @staticmethod
    def binary() -> str | None:
        return shutil.which("etcd")

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        binary = self.binary()
        if binary is None:
            raise RuntimeError("etcd is not installed (make etcd: Debian's etcd-server)")
        self.root.mkdir(parents=True, exist_ok=True)
        peer = f"http://127.0.0.1:{self.peer}"
        self.proc = subprocess.Popen(
            [binary, "--name", "bench", "--data-dir", str(self.root / "data"), "--listen-client-urls", self.url,
             "--advertise-client-urls", self.url, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"bench={peer}", "--listen-metrics-urls", f"http://127.0.0.1:{free_port()}"],
            stdout=open(self.root / "etcd.log", "ab"), stderr=subprocess.STDOUT, start_new_session=True)

        def answers() -> bool:
            try:
                return httpx.post(f"{self.url}/v3/maintenance/status", json={}, timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        until(answers, "etcd to answer", 60, 0.2)

    def stop(self) -> None:
        if self.running():
            assert self.proc is not None
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class _quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> bool:
        return exc[0] is not None and issubclass(exc[0], (ProcessLookupError, PermissionError))
