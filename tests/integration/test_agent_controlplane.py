"""The agent against the real control plane (``llmgw server``), both as processes.

The recording control plane in test_agent_process.py lets a test dictate
every command; this one checks the agent's side of the contract holds with
the real reconciler deciding: a catalogued replica is placed on the agent's
GPUs, becomes Ready through the agent's completion probe, survives repeated
SIGKILLs of its agent (adopted, same process), and is really stopped, group
and all, when the catalog stops asking for it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import ssl
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from llmgw.agent import procident
from llmgw.tls import client_context, init_ca, issue_admin, issue_node, issue_server
from llmgw.tls.files import write_pair
from tests.support.ports import engine_port_block, free_port

from fleet import until

pytestmark = pytest.mark.integration

WAIT = 120.0
ROOT = Path(__file__).resolve().parents[2]
HARDWARE = ROOT / "tests" / "fixtures" / "hardware" / "pcie-4gpu-nvlink-pairs.yaml"
SIM_SCRIPT = Path(sys.executable).parent / "llmgw-engine-sim"




def server_doc(tmp: Path, port: int, replicas: int) -> dict:
    return {
        "api": {"listen": {"host": "127.0.0.1", "port": port}},
        "tls": {"ca": str(tmp / "ca" / "ca.crt"), "cert": str(tmp / "server.crt"), "key": str(tmp / "server.key")},
        "lifecycle": {"heartbeat_interval": 1, "keepalive_interval": 2, "unreachable_after": 10,
                      "lost_after": 60, "startup_grace": 2},
        "models": [{"name": "tiny", "source": "org/tiny", "size_bytes": 1000000}],
        "profiles": [{"name": "sim", "engine": "vllm", "start_timeout": 90}],
        "deployments": [{"model": "tiny", "profile": "sim", "replicas": replicas}] if replicas else [],
    }


class Proc:
    def __init__(self, argv: list[str], log: Path):
        self.log = log
        with open(log, "ab") as f:
            self.p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-15000:]

    def end(self, sig: int = signal.SIGTERM) -> None:
        if self.p.poll() is None:
            self.p.send_signal(sig)
            try:
                self.p.wait(WAIT)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(WAIT)


def test_real_control_plane_places_on_the_agent_which_survives_sigkills_and_stops_when_the_catalog_drops_it(tmp_path):
    ca = init_ca(tmp_path / "ca")
    write_pair(tmp_path / "server", *issue_server(ca, ["localhost"], ["127.0.0.1"]))
    node = f"node-{os.getpid()}-{random.randrange(1 << 20):x}"
    ncrt, nkey = write_pair(tmp_path / "node", *issue_node(ca, node))
    acrt, akey = write_pair(tmp_path / "admin", *issue_admin(ca, "ops"))
    admin_ctx: ssl.SSLContext = client_context(ca.cert_path, acrt, akey)
    port = free_port()
    server_yaml = tmp_path / "server.yaml"
    server_yaml.write_text(yaml.safe_dump(server_doc(tmp_path, port, replicas=1)))
    engine = tmp_path / "engine-sim"  # this test's own engine command: its scan matches nothing else
    engine.write_bytes(SIM_SCRIPT.read_bytes())
    engine.chmod(0o755)
    first = engine_port_block(200)
    agent_yaml = tmp_path / "agent.yaml"
    agent_yaml.write_text(yaml.safe_dump({
        "node_id": node,
        "control_plane": {"url": f"wss://127.0.0.1:{port}/v1/agent/stream", "reconnect_initial": 0.2,
                          "reconnect_max": 1.0},
        "tls": {"ca": str(ca.cert_path), "cert": str(ncrt), "key": str(nkey)},
        "state_dir": str(tmp_path / "state"),
        "engine_bind_host": "127.0.0.1",
        "engine_ports": {"first": first, "last": first + 199},
        "discovery": {"gpus": "simulated", "hardware_file": str(HARDWARE), "sysfs_root": str(tmp_path / "nosys")},
        "engines": {"vllm": [str(engine)]},
    }))

    def api(path: str) -> dict:
        with urllib.request.urlopen(f"https://127.0.0.1:{port}{path}", context=admin_ctx, timeout=WAIT) as r:
            return json.loads(r.read())

    server = Proc([sys.executable, "-m", "llmgw", "server", "--config", str(server_yaml)], tmp_path / "server.log")
    agent_argv = [sys.executable, "-m", "llmgw", "agent", "--config", str(agent_yaml)]
    agent = Proc(agent_argv, tmp_path / "agent.log")
    identity = None
    try:
        def logs() -> str:
            return f"--- server ---\n{server.output()}\n--- agent ---\n{agent.output()}"

        def ready_replica():
            try:
                reps = api("/v1/replicas")["replicas"]
            except OSError:
                return None
            return next((r for r in reps if r["state"] == "ready"), None)

        rep = until(ready_replica, "a Ready replica", on_timeout=logs)
        (shard,) = rep["shards"]
        assert shard["node_id"] == node and shard["state"] == "ready"
        identity = procident.ProcessIdentity.from_dict(shard["process"])
        replica_id = rep["replica_id"]
        assert procident.is_running(identity)

        for life in range(1, 4):
            registrations = next(n for n in api("/v1/nodes")["nodes"] if n["node_id"] == node)["registrations"]
            agent.end(signal.SIGKILL)
            assert procident.is_running(identity)
            agent = Proc(agent_argv, tmp_path / "agent.log")
            until(lambda: next(n for n in api("/v1/nodes")["nodes"] if n["node_id"] == node)["registrations"]
                  > registrations, f"re-registration #{life}", on_timeout=logs)
            rep = until(ready_replica, "the replica Ready again", on_timeout=logs)
            assert rep["replica_id"] == replica_id and rep["shards"][0]["process"] == identity.to_dict()
            assert rep["shards"][0]["adopted"] is True
            assert procident.is_running(identity)

        # The catalog stops asking for it: the control plane sends stop, the agent kills the adopted engine.
        server_yaml.write_text(yaml.safe_dump(server_doc(tmp_path, port, replicas=0)))
        server.p.send_signal(signal.SIGHUP)
        until(lambda: not procident.is_running(identity), "the adopted engine to be stopped", on_timeout=logs)
        until(lambda: api("/v1/replicas")["replicas"] == [], "the replica to be gone", on_timeout=logs)
        until(lambda: not list((tmp_path / "state" / "shards").iterdir()), "the record to be removed", on_timeout=logs)
        assert agent.p.poll() is None and server.p.poll() is None
    finally:
        agent.end()
        server.end()
        if identity is not None and procident.is_same_process(identity):
            os.killpg(identity.pid, signal.SIGKILL)
