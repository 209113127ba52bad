"""A whole fleet on one machine, as real processes: CA, control plane, agents, engines.

    with Fleet(tmp_path, nodes={"node-a": 1, "node-b": 1}, replicas=1) as f:
        f.start()
        f.wait_ready(1)
        ...

- the PKI is real (``llmgw.tls``): a CA, a server certificate for 127.0.0.1,
  one node certificate per agent, an admin certificate and an admin token;
- ``llmgw server`` and each ``llmgw agent`` run as ``python -m llmgw ...``
  with output to a log file (never a pipe);
- engines are the simulator, launched by the agents through the real vLLM
  adapter.  Each fleet runs its own copy of the simulator script, and every
  engine carries its node id in its environment, so cleanup can find
  exactly this fleet's engines and nothing else;
- tests poll the admin API for conditions with generous timeouts, never
  sleep-and-hope.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import random
import shutil
import signal
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.hardware.types import GPU, HardwareInventory
from llmgw.tls import init_ca, issue_admin, issue_node, issue_router, issue_server
from llmgw.tls.ca import key_to_pem
from llmgw.tls.context import client_context
from llmgw.tls.files import write_pair
from tests.support.childenv import child_env
from tests.support.fleetclient import admin_client
from tests.support.polling import WAIT, until
from tests.support.ports import engine_port_block, free_port
from tests.support.procfs import start_time as process_start_time  # noqa: F401 (tests import it from here)

SIM_SCRIPT = Path(sys.executable).parent / "llmgw-engine-sim"
ADMIN_TOKEN = "test-admin-token-" + "x" * 16
GIB = 1 << 30

# Short lifecycle timings so a test sees unreachable/lost in seconds.
FAST_LIFECYCLE = {"heartbeat_interval": 0.5, "keepalive_interval": 1.0, "unreachable_after": 3.0,
                  "lost_after": 6.0, "startup_grace": 4.0, "max_unreachable_share": 0.55,
                  "replacements_per_minute": 30, "stream_grace": 2.0}



def self_signed_node(node_id: str) -> tuple[bytes, bytes]:
    """(certificate, key) PEM that look exactly like a node certificate but sign themselves."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "llmgw"),
                      x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "node"),
                      x509.NameAttribute(NameOID.COMMON_NAME, node_id)])
    now = dt.datetime.now(dt.timezone.utc)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(ski, critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
            .sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM), key_to_pem(key)


# ---------------------------------------------------------------------- PKI

@dataclass
class Pki:
    dir: Path
    ca: Any
    server: tuple[Path, Path]
    admin: tuple[Path, Path]
    router: tuple[Path, Path]  # a standalone router's: serves clients, reads the watch with engine keys

    @property
    def ca_cert(self) -> Path:
        return self.ca.cert_path

    def node(self, node_id: str) -> tuple[Path, Path]:
        return write_pair(self.dir / f"node-{node_id}", *issue_node(self.ca, node_id))

    def admin_context(self) -> ssl.SSLContext:
        return client_context(self.ca_cert, *self.admin)


def make_pki(root: Path, hosts: tuple[str, ...] = ("localhost",), ips: tuple[str, ...] = ("127.0.0.1",)) -> Pki:
    ca = init_ca(root / "ca")
    server = write_pair(root / "server", *issue_server(ca, list(hosts), list(ips)))
    admin = write_pair(root / "admin", *issue_admin(ca, "operator"))
    router = write_pair(root / "router", *issue_router(ca, list(hosts), list(ips)))
    return Pki(root, ca, server, admin, router)


# ------------------------------------------------------------------ processes

def simulated_inventory(node_id: str, gpus: int) -> HardwareInventory:
    """``gpus`` simulated 80 GiB GPUs, all NVLink peers of each other."""
    return HardwareInventory(node_id=node_id, gpu_source="simulated", gpus=tuple(
        GPU(i, f"GPU-{node_id}-{i:02d}", "Simulated H100 80GB", 80 * GIB, f"00000000:{0x10 + i:02X}:00.0",
            nvlink_peers=tuple(j for j in range(gpus) if j != i)) for i in range(gpus)))


def hardware_file(path: Path, node_id: str, gpus: int) -> Path:
    path.write_text(yaml.safe_dump(simulated_inventory(node_id, gpus).to_dict()))
    return path


class Proc:
    """A ``python -m llmgw ...`` process with its output in a file."""

    def __init__(self, name: str, argv: list[str], log_path: Path, cwd: Path):
        self.name, self.argv, self.log_path, self.cwd = name, argv, log_path, cwd
        self.proc: subprocess.Popen | None = None
        self.lives = 0
        self.stopped = False

    def start(self) -> "Proc":
        self.lives += 1
        with open(self.log_path, "ab") as log:
            log.write(f"----- {self.name} life {self.lives}\n".encode())
            log.flush()
            # run in a directory of its own, it must still import this tree
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=self.cwd, env=child_env())
        self.stopped = False
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        if sig == signal.SIGSTOP:
            self.stopped = True
        elif sig == signal.SIGCONT:
            self.stopped = False

    def kill(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
            self.proc.wait(WAIT)  # type: ignore[union-attr]

    def terminate(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        if self.stopped:
            self.proc.send_signal(signal.SIGCONT)
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(WAIT)

    def output(self, last: int = 30000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-last:]
        except FileNotFoundError:
            return ""

    def life_output(self) -> str:
        """Output of the current life only."""
        text = self.output(last=10_000_000)
        marker = f"----- {self.name} life {self.lives}\n"
        return text[text.rfind(marker):] if marker in text else text


def llmgw_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "llmgw", "--log-level", "DEBUG", *args]


# ---------------------------------------------------------------------- fleet

class Fleet:
    def __init__(self, root: Path, nodes: dict[str, int], replicas: int = 1, *,
                 lifecycle: dict[str, float] | None = None, restart: dict[str, float] | None = None,
                 profile: dict[str, Any] | None = None, router: bool = False, router_http: bool = False,
                 pki: Pki | None = None, api_host: str = "127.0.0.1", stream_host: str = "127.0.0.1",
                 agent_keepalive: float | None = None):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.pki = pki or make_pki(root / "pki")
        self.port = free_port()
        self.router_port = free_port() if router else None
        self.url = f"https://{api_host}:{self.port}"
        self.stream_url = f"wss://{stream_host}:{self.port}/v1/agent/stream"
        self.sim = root / "engine-sim"
        shutil.copy(SIM_SCRIPT, self.sim)
        self.sim.chmod(0o755)
        self.suffix = f"{os.getpid()}-{random.randrange(1 << 20):05x}"
        self.node_ids = {name: f"{name}-{self.suffix}" for name in nodes}
        self.gpus = nodes
        self.agent_keepalive = agent_keepalive
        self.config: dict[str, Any] = {
            "api": {"listen": {"host": "127.0.0.1", "port": self.port},
                    "admin_tokens": [{"name": "tests", "sha256": _sha256(ADMIN_TOKEN)}]},
            "tls": {"ca": str(self.pki.ca_cert), "cert": str(self.pki.server[0]), "key": str(self.pki.server[1])},
            "lifecycle": {**FAST_LIFECYCLE, **(lifecycle or {})},
            "restart": {"backoff_initial": 0.5, "backoff_max": 2.0, **(restart or {})},
            # the grant secret lives here: a restarted control plane adopts the engines it placed
            "state_dir": str(root / "cp-state"),
            "models": [{"name": "tiny", "source": "org/tiny"}],
            "profiles": [{"name": "sim", "engine": "vllm", "start_timeout": 60, **(profile or {})}],
            "deployments": [{"model": "tiny", "profile": "sim", "replicas": replicas}],
        }
        self.router_http = router_http
        if router:
            # HTTPS with the fleet CA's router certificate, as the collection deploys it; plain
            # HTTP (router_http) only as an operator may set it explicitly, for tests about other things
            tls = {"insecure_http": True} if router_http else {
                "tls": {"cert": str(self.pki.router[0]), "key": str(self.pki.router[1])}}
            self.config["router"] = {"listen": {"host": "127.0.0.1", "port": self.router_port},
                                     "allow_unauthenticated": True, **tls}
        self.config_path = root / "server.yaml"
        self.write_config()
        self.server = Proc("server", llmgw_argv("server", "--config", str(self.config_path)),
                           root / "server.log", root)
        self.agents: dict[str, Proc] = {}
        for name, gpus in nodes.items():
            self.agents[name] = self._agent(name, gpus)
        self.extra: list[Proc] = []

    @property
    def router_url(self) -> str:
        """The in-process router; verify it with ``router_verify()``."""
        return f"{'http' if self.router_http else 'https'}://127.0.0.1:{self.router_port}"

    def router_verify(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.pki.ca_cert))

    def openai_client(self, timeout: float = 60) -> Any:
        """The official ``openai`` client on the in-process router (no retries: a test sees every answer)."""
        import openai

        return openai.OpenAI(base_url=f"{self.router_url}/v1", api_key="unused", max_retries=0,
                             http_client=httpx.Client(verify=self.router_verify(), timeout=timeout))

    # -- setup ---------------------------------------------------------------
    def write_config(self, doc: dict[str, Any] | None = None) -> None:
        self.config_path.write_text(yaml.safe_dump(doc if doc is not None else self.config))

    def _agent(self, name: str, gpus: int) -> Proc:
        node_id = self.node_ids[name]
        d = self.root / name
        d.mkdir(exist_ok=True)
        crt, key = self.pki.node(node_id)
        first = engine_port_block(100)
        cfg = {
            "node_id": node_id,
            "control_plane": {"url": self.stream_url, "reconnect_initial": 0.2, "reconnect_max": 1.0},
            "tls": {"ca": str(self.pki.ca_cert), "cert": str(crt), "key": str(key)},
            "state_dir": str(d / "state"),
            "advertise_address": "127.0.0.1",
            "engine_bind_host": "127.0.0.1",
            "engine_ports": {"first": first, "last": first + 99},
            "discovery": {"gpus": "simulated", "hardware_file": str(hardware_file(d / "hardware.yaml", node_id, gpus)),
                          "sysfs_root": str(d / "no-sysfs")},
            "engines": {"vllm": [str(self.sim)], "sglang": [str(self.sim), "sglang"]},
        }
        if self.agent_keepalive is not None:
            cfg["control_plane"]["keepalive_interval"] = self.agent_keepalive
        (d / "agent.yaml").write_text(yaml.safe_dump(cfg))
        return Proc(f"agent {name}", llmgw_argv("agent", "--config", str(d / "agent.yaml")), d / "agent.log", d)

    def start(self, agents: bool = True) -> "Fleet":
        self.server.start()
        self.wait_healthy()
        if agents:
            for a in self.agents.values():
                a.start()
        return self

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for p in [*self.extra, *self.agents.values(), self.server]:
            p.terminate()
        for pid in self.engine_pids():
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass

    # -- API -----------------------------------------------------------------
    def client(self, token: str | None = None, cert: tuple[Path, Path] | None = None) -> httpx.Client:
        """An API client: admin certificate by default, or ``token``/``cert`` as given."""
        if token is None and cert is None:
            cert = self.pki.admin
        return admin_client(self.url, self.pki.ca_cert, cert, token)

    def get(self, path: str) -> Any:
        with self.client() as c:
            r = c.get(path)
            r.raise_for_status()
            return r.json()

    def try_get(self, path: str) -> Any | None:
        try:
            return self.get(path)
        except (httpx.HTTPError, OSError):
            return None

    def wait_healthy(self) -> None:
        def ok() -> bool:
            if not self.server.alive():
                raise AssertionError(f"control plane exited\n{self.server.output()}")
            return self.try_get("/healthz") is not None
        until(ok, "control plane /healthz", on_timeout=self.server.output)

    def replicas(self) -> dict[str, Any]:
        return self.get("/v1/replicas")

    def nodes(self) -> dict[str, dict[str, Any]]:
        return {n["node_id"]: n for n in self.get("/v1/nodes")["nodes"]}

    def try_node(self, name: str) -> dict[str, Any] | None:
        """Agent ``name``'s node as the API shows it; None while the API does not answer or lacks it."""
        try:
            with self.client() as c:
                r = c.get(f"/v1/nodes/{self.node_ids[name]}")
        except (httpx.HTTPError, OSError):
            return None
        return r.json() if r.status_code == 200 else None

    def drop_stream(self, agent: "Proc") -> None:
        """Freeze the control plane until ``agent``'s keepalive gives up on the stream, then thaw it.

        The agent redials with its backoff and registers again, rediscovering
        on the way: the test's way to make one agent reconnect without
        restarting either process.
        """
        closed = agent.life_output().count("stream closed")
        self.server.signal(signal.SIGSTOP)
        try:
            until(lambda: agent.life_output().count("stream closed") > closed,
                  "the agent to drop the frozen control plane's stream", on_timeout=agent.output)
        finally:
            self.server.signal(signal.SIGCONT)

    def ready_replicas(self) -> list[dict[str, Any]]:
        doc = self.try_get("/v1/replicas")
        return [] if doc is None else [r for r in doc["replicas"] if r["state"] == "ready"]

    def wait_ready(self, count: int, timeout: float = WAIT, extra: Callable[[list[dict]], bool] | None = None
                   ) -> list[dict[str, Any]]:
        def done():
            ready = self.ready_replicas()
            if len(ready) == count and (extra is None or extra(ready)):
                return ready
            return None
        return until(done, f"{count} replica(s) ready", timeout, on_timeout=self.dump)

    def dump(self) -> str:
        parts = [f"--- replicas ---\n{json.dumps(self.try_get('/v1/replicas'), indent=1)[:6000]}",
                 f"--- server ---\n{self.server.output(12000)}"]
        for name, a in self.agents.items():
            parts.append(f"--- agent {name} ---\n{a.output(6000)}")
        for p in self.extra:  # a test's other control planes (ha) and processes: why nothing answered
            parts.append(f"--- {p.name} ---\n{p.output(6000)}")
        return "\n".join(parts)

    def ctl(self, *args: str, env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
        """``llmgw ctl ARGS`` with the admin certificate from the environment."""
        e = {**os.environ, "LLMGW_URL": self.url, "LLMGW_CA": str(self.pki.ca_cert),
             "LLMGW_CERT": str(self.pki.admin[0]), "LLMGW_KEY": str(self.pki.admin[1]), **(env or {})}
        res = subprocess.run([sys.executable, "-m", "llmgw", "ctl", *args], env=e, capture_output=True,
                             text=True, timeout=WAIT)
        if check and res.returncode != 0:
            raise AssertionError(f"ctl {' '.join(args)} exited {res.returncode}\n{res.stdout}\n{res.stderr}")
        return res

    # -- engines -------------------------------------------------------------
    def engine_pids(self) -> list[int]:
        """Process-group leaders of this fleet's engines (found by node id in their environment)."""
        ours = {v.encode() for v in self.node_ids.values()}
        out = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            pid = int(entry)
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                if os.getpgid(pid) != pid:
                    continue
            except OSError:
                continue
            for item in env:
                if item.startswith(b"LLMGW_NODE_ID=") and item.split(b"=", 1)[1] in ours:
                    if any(i.startswith(b"LLMGW_SHARD_ID=") for i in env):
                        out.append(pid)
                    break
        return sorted(out)


def _sha256(s: str) -> str:
    import hashlib

    return hashlib.sha256(s.encode()).hexdigest()


def shard_identities(doc: dict[str, Any]) -> dict[str, tuple[str, int, int]]:
    """shard id -> (node, pid, start time) for every shard that reports a process."""
    out = {}
    for r in doc["replicas"]:
        for s in r["shards"]:
            if s.get("process"):
                out[s["shard_id"]] = (s["node_id"], s["process"]["pid"], s["process"]["start_time"])
    return out


def gpu_owners(doc: dict[str, Any]) -> dict[tuple[str, int], list[str]]:
    """(node, gpu) -> shards holding it, for shards not ended."""
    owners: dict[tuple[str, int], list[str]] = {}
    for r in doc["replicas"]:
        for s in r["shards"]:
            if s["state"] not in ("failed", "stopped", "gone") and s.get("node_id"):
                for g in s["gpus"]:
                    owners.setdefault((s["node_id"], g), []).append(s["shard_id"])
    return owners


# ------------------------------------------------- helpers added for e2e tests
# (additions only: nothing above changes behaviour)

def register_message(node_id: str, gpus: int = 1, shards: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A valid ``register`` for ``node_id`` reporting ``shards`` (none by default)."""
    return {"type": "register", "node_id": node_id, "agent_version": "test", "boot_id": "boot-test",
            "address": "127.0.0.1", "hardware": simulated_inventory(node_id, gpus).to_dict(),
            "shards": list(shards or [])}


def edit_agent_config(agent: Proc, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Apply ``change`` to an agent's agent.yaml (before it starts); returns the new document."""
    path = agent.cwd / "agent.yaml"
    doc = yaml.safe_load(path.read_text())
    change(doc)
    path.write_text(yaml.safe_dump(doc))
    return doc


def metric_samples(f: "Fleet") -> dict[str, list[tuple[dict[str, str], float]]]:
    """``/metrics`` of the real server, parsed: sample name -> [(labels, value)]."""
    from prometheus_client.parser import text_string_to_metric_families

    with f.client() as c:
        r = c.get("/metrics")
        r.raise_for_status()
        text = r.text
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def log_times(text: str, needle: str) -> list[float]:
    """Epoch seconds of every log line (``%(asctime)s`` format) containing ``needle``, in order."""
    import datetime as _dt

    out = []
    for line in text.splitlines():
        if needle in line:
            try:
                stamp = _dt.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            except ValueError:
                continue
            out.append(stamp.timestamp())
    return out


def standalone_router(f: Fleet, name: str = "router", extra: dict[str, Any] | None = None) -> tuple[Proc, int]:
    """``llmgw router`` fed by the control plane's watch API with a router certificate (engine keys).

    ``name`` other than "router": a router of its own, with its own certificate (CN ``name``).
    """
    port = free_port()
    cert = f.pki.router if name == "router" else write_pair(
        f.pki.dir / name, *issue_router(f.pki.ca, [name, "localhost"], ["127.0.0.1"]))
    cfg = {"listen": {"host": "127.0.0.1", "port": port}, "allow_unauthenticated": True, "insecure_http": True,
           "control_plane": {"url": f.url, "ca": str(f.pki.ca_cert), "cert": str(cert[0]),
                             "key": str(cert[1])}, **(extra or {})}
    path = f.root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = Proc(name, llmgw_argv("router", "--config", str(path)), f.root / f"{name}.log", f.root)
    f.extra.append(proc)
    return proc.start(), port


def stream_first_token(client: Any, model: str = "tiny") -> tuple[float, float, str]:
    """(seconds to the first token, seconds to the end, the text) of one streamed completion."""
    began = time.monotonic()
    first, text = None, ""
    for chunk in client.completions.create(model=model, prompt="hello", max_tokens=4, stream=True):
        if chunk.choices and chunk.choices[0].text:
            first = first if first is not None else time.monotonic() - began
            text += chunk.choices[0].text
    assert first is not None, "no token"
    return first, time.monotonic() - began, text


def router_endpoints(port: int) -> int | None:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).json()["endpoints"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None


def role(f: "Fleet", url: str) -> str | None:
    """"leader", "standby", or None when it does not answer."""
    try:
        with httpx.Client(base_url=url, verify=client_context(f.pki.ca_cert, *f.pki.admin), timeout=3) as c:
            r = c.get("/v1/nodes")
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    return r.headers.get("X-Llmgw-Role", "leader")
