"""Two hundred simulated agents against a real control plane: the fleet-scale behaviours, in short.

``llmgw-fleet-sim`` runs as its own process (each agent: its own node
certificate, TLS 1.3, the agent's stream client and supervisor); the control
plane is a real ``llmgw server``.  Everything asserted is read from the
control plane's admin API, as ``llmgw ctl`` reads it, or from the simulator's
status file and control socket.  One fleet serves the whole module, and each
test leaves it healed for the next.

Lifecycle timings are short (heartbeat 1 s, lost after 6 s) so the scenarios
take seconds; nothing here measures speed.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from fleet_sim import NODES, REAL, Sim, assert_no_gpu_twice, nodes_doc, placement, read_json
from fleet import Fleet, Proc, until
from llmgw.sim.fleet.client import send_command
from tests.support.procfs import tcp_clients_of

pytestmark = pytest.mark.integration

# keepalive 3 s: aiohttp wants a pong within half the interval, and two hundred
# agents in one process on a busy 2-core machine do not always answer in 0.5 s.
# startup_grace 15 s: every agent must re-register inside it after the
# control-plane restart, or its replicas are placed afresh; on a loaded
# machine two hundred TLS handshakes and registers take several seconds.
LIFECYCLE = {"heartbeat_interval": 1.0, "keepalive_interval": 3.0, "unreachable_after": 5.0, "lost_after": 8.0,
             "startup_grace": 15.0, "max_unreachable_share": 0.55, "replacements_per_minute": 600,
             "stream_grace": 10.0}
PROFILES = [{"name": "tp1", "engine": "vllm", "start_timeout": 60},
            {"name": "tp2", "engine": "vllm", "start_timeout": 60, "tensor_parallel_size": 2},
            {"name": "tp4", "engine": "vllm", "start_timeout": 60, "tensor_parallel_size": 4},
            {"name": "tp8", "engine": "vllm", "start_timeout": 60, "tensor_parallel_size": 8},
            {"name": "two-node", "engine": "vllm", "start_timeout": 60, "tensor_parallel_size": 8, "nodes": 2}]
DEPLOYMENTS = {"tp1": 80, "tp2": 40, "tp4": 30, "tp8": 20, "two-node": 4}
REPLICAS = sum(DEPLOYMENTS.values()) + REAL
WAIT = 120.0


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, Sim]]:
    root = tmp_path_factory.mktemp("fleetsim")
    f = Fleet(root, nodes={}, lifecycle=LIFECYCLE, router=True, router_http=True)
    f.config["profiles"] = PROFILES
    f.config["models"].append({"name": "real", "source": "org/real"})
    f.config["deployments"] = [{"model": "tiny", "profile": p, "replicas": n} for p, n in DEPLOYMENTS.items()]
    f.config["deployments"].append({"model": "real", "profile": "tp1", "replicas": REAL})
    f.write_config()
    sim = Sim(f, root)
    f.extra.append(sim.proc)
    try:
        f.start(agents=False)
        sim.proc.start()
        yield f, sim
    finally:
        sim.close()
        f.close()
        kill_engines(sim.prefix)


def kill_engines(prefix: str) -> None:
    """Engines the simulator launched and did not stop (it stops them on SIGTERM; this is for a crash)."""
    import os
    import signal

    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(e.startswith(f"LLMGW_NODE_ID={prefix}-".encode()) for e in env):
            try:
                os.killpg(int(pid), signal.SIGKILL)
            except OSError:
                pass


def dump(f: Fleet, sim: Sim) -> str:
    return f"--- sim status ---\n{json.dumps(sim.status())[:3000]}\n--- sim ---\n{sim.proc.output(6000)}\n" \
           f"--- server ---\n{f.server.output(8000)}"


def node_states(f: Fleet) -> dict[str, str]:
    doc = nodes_doc(f)
    return {} if doc is None else {n["node_id"]: n["state"] for n in doc["nodes"]}


def all_ready(f: Fleet) -> dict[str, Any] | None:
    doc = f.try_get("/v1/replicas")
    if doc is None or len(doc["replicas"]) != REPLICAS or doc["unplaced"]:
        return None
    return doc if all(r["state"] == "ready" for r in doc["replicas"]) else None


def fleet_ready(f: Fleet, sim: Sim, what: str) -> dict[str, Any]:
    until(lambda: len(s := node_states(f)) == NODES and set(s.values()) == {"ready"}, f"{what}: every node ready",
          WAIT, on_timeout=lambda: dump(f, sim), interval=1.0)
    return until(lambda: all_ready(f), f"{what}: every replica ready", WAIT, on_timeout=lambda: dump(f, sim),
                 interval=1.0)


def test_cold_start_registers_every_node_and_readies_every_replica(fleet: tuple[Fleet, Sim]) -> None:
    f, sim = fleet
    doc = fleet_ready(f, sim, "cold start")
    assert_no_gpu_twice(doc)
    st = until(lambda: (s := sim.status()) and s["registered"] == NODES and s, "the status file to show every node",
               WAIT, on_timeout=lambda: dump(f, sim))
    assert st["registrations"] >= NODES and st["messages_sent"]["register"] >= NODES
    assert st["messages_sent"]["heartbeat"] > 0
    assert st["progress_sent"] > 0  # the download phase reported progress
    # each agent dials from a loopback address of its own, as from its own machine
    sources = [ip for ip in tcp_clients_of(f.port) if ip.startswith("127.1.")]
    # one address per agent, every agent's: a shared address would show fewer addresses than nodes.
    # Not one connection each: a loaded CI host once showed 202 for 200 registered streams, a dial
    # or two in flight (each agent's second connection from its own address)
    assert len(set(sources)) == NODES, sorted(sources)[:5]
    nodes = nodes_doc(f)["nodes"]
    # every node registered with its own hardware: distinct GPU UUIDs fleet-wide
    uuids = [g["uuid"] for n in nodes for g in n["gpus"]]
    assert len(uuids) == len(set(uuids)) == sum(n["gpus_total"] for n in nodes)
    assert {fab["name"] for n in nodes for fab in n["fabrics"]} == {"ib-ndr", "ib-hdr"}
    two_node = [r for r in doc["replicas"] if r["profile"] == "two-node"]
    assert len(two_node) == DEPLOYMENTS["two-node"] and all(len({s["node_id"] for s in r["shards"]}) == 2
                                                            for r in two_node)


def test_real_engines_serve_through_the_router(fleet: tuple[Fleet, Sim]) -> None:
    f, sim = fleet
    doc = fleet_ready(f, sim, "before the requests")
    real = [r for r in doc["replicas"] if r["model"] == "real"]
    assert len(real) == REAL and all(r["shards"][0]["port"] < 20000 or r["shards"][0]["port"] > 29999 for r in real)
    assert sim.status()["engines_started"] == REAL
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{f.router_port}/v1", api_key="unused", max_retries=0,
                           timeout=60)
    for _ in range(4):
        out = client.completions.create(model="real", prompt="hello", max_tokens=4)
        assert out.choices[0].text
    eps = f.get("/v1/router/endpoints")
    assert len(eps["endpoints"]) == REPLICAS  # the router's watch carries every replica of the fleet


def test_control_plane_sigkill_costs_nothing(fleet: tuple[Fleet, Sim]) -> None:
    f, sim = fleet
    before = placement(fleet_ready(f, sim, "before the kill"))
    regs = sim.status()["registrations"]
    f.server.kill()
    f.server.start()
    f.wait_healthy()
    def reregistered() -> bool:  # the simulator's status: polling the API would load the control plane
        st = sim.status()
        return bool(st and st["registrations"] >= regs + NODES and st["registered"] == NODES)

    until(reregistered, "every agent to register again", WAIT, on_timeout=lambda: dump(f, sim), interval=0.3)
    after = fleet_ready(f, sim, "after the restart")
    assert " -> lost " not in f.server.life_output(), "a node was declared lost across the restart"
    assert placement(after) == before, "a replica was restarted or moved by the control-plane restart"
    assert all(r["restarts"] == 0 for r in after["replicas"])
    assert_no_gpu_twice(after)
    assert all(n["registrations"] == 1 for n in nodes_doc(f)["nodes"])  # the new process saw each node once


def test_sixty_percent_silent_past_lost_after_loses_nothing(fleet: tuple[Fleet, Sim]) -> None:
    f, sim = fleet
    before = placement(fleet_ready(f, sim, "before the silence"))
    silenced = set(sim.command("silence 0.6")["nodes"])
    assert len(silenced) == round(0.6 * NODES)
    lost_after = LIFECYCLE["lost_after"]

    def silent_long_enough() -> bool:
        doc = nodes_doc(f)
        if doc is None:
            return False
        mine = [n for n in doc["nodes"] if n["node_id"] in silenced]
        assert all(n["state"] != "lost" for n in doc["nodes"]), "a node was declared lost"
        return all(n["state"] == "unreachable" and n["last_seen_s"] > lost_after + 1 for n in mine) \
            and doc["fleet"]["damped"]

    until(silent_long_enough, "the silenced nodes to stay silent past lost_after", WAIT,
          on_timeout=lambda: dump(f, sim), interval=1.0)
    assert placement(f.replicas()) == before, "a replica moved while the fleet was damped"
    assert all(n["connected"] for n in nodes_doc(f)["nodes"])  # silent, not disconnected
    sim.command("heal")
    after = fleet_ready(f, sim, "after heal")
    assert placement(after) == before
    assert_no_gpu_twice(after)


def test_five_percent_silent_are_lost_and_their_replicas_replaced(fleet: tuple[Fleet, Sim]) -> None:
    f, sim = fleet
    doc = fleet_ready(f, sim, "before the loss")
    # the silenced nodes are ten that hold single-node replicas, so losing them must move something
    real_hosts = {s["node_id"] for r in doc["replicas"] if r["model"] == "real" for s in r["shards"]}
    hosts = sorted({s["node_id"] for r in doc["replicas"] if r["profile"] != "two-node" for s in r["shards"]}
                   - real_hosts)
    victims = set(hosts[:: max(1, len(hosts) // 10)][:10])
    moved = {r["replica_id"] for r in doc["replicas"] if {s["node_id"] for s in r["shards"]} & victims}
    assert victims and moved
    sim.command("silence ids=" + ",".join(sorted(victims)))

    def replaced() -> dict[str, Any] | None:
        states = node_states(f)
        if {n for n, s in states.items() if s == "lost"} != victims:
            return None
        d = all_ready(f)
        if d is None or any(s["node_id"] in victims for r in d["replicas"] for s in r["shards"]):
            return None
        return d

    after = until(replaced, "the silent nodes lost and their replicas ready elsewhere", WAIT,
                  on_timeout=lambda: dump(f, sim), interval=1.0)
    assert {n for n, s in node_states(f).items() if s == "lost"} == victims  # only the silent ones
    assert_no_gpu_twice(after)
    sim.command("heal")
    healed = fleet_ready(f, sim, "after the lost nodes came back")
    assert_no_gpu_twice(healed)


def test_killed_agents_come_back_and_their_engines_are_adopted(fleet: tuple[Fleet, Sim]) -> None:
    f, sim = fleet
    before = placement(fleet_ready(f, sim, "before the kill"))
    regs = {n["node_id"]: n["registrations"] for n in nodes_doc(f)["nodes"]}
    hosts = sorted({s["node_id"] for r in f.replicas()["replicas"] for s in r["shards"]})
    killed = set(sim.command("kill ids=" + ",".join(hosts[:5]) + " 1")["nodes"])
    assert killed == set(hosts[:5])

    def back() -> bool:
        doc = nodes_doc(f)
        return doc is not None and all(n["registrations"] > regs[n["node_id"]] for n in doc["nodes"]
                                       if n["node_id"] in killed)

    until(back, "the killed agents to register again", WAIT, on_timeout=lambda: dump(f, sim), interval=1.0)
    after = fleet_ready(f, sim, "after the agents' restart")
    assert placement(after) == before, "an agent restart restarted or moved a replica"
    adopted = {s["node_id"] for r in after["replicas"] for s in r["shards"] if s["adopted"]}
    assert killed <= adopted


def test_malformed_messages_close_only_their_senders_stream(fleet: tuple[Fleet, Sim]) -> None:
    f, sim = fleet
    fleet_ready(f, sim, "before the bad messages")
    regs = {n["node_id"]: n["registrations"] for n in nodes_doc(f)["nodes"]}
    malformed = set(sim.command("malformed n=3")["nodes"])
    oversized = set(sim.command("oversized n=2")["nodes"])
    bad = malformed | oversized
    assert len(bad) >= 3

    def reregistered() -> dict[str, int] | None:
        doc = nodes_doc(f)
        now = {} if doc is None else {n["node_id"]: n["registrations"] for n in doc["nodes"]}
        return now if all(now.get(n, 0) > regs[n] for n in bad) else None

    until(reregistered, "the senders of bad messages to be cut off and register again", WAIT,
          on_timeout=lambda: dump(f, sim), interval=1.0)
    time.sleep(2 * LIFECYCLE["heartbeat_interval"])  # room for a wrongly closed stream to show up
    now = {n["node_id"]: n["registrations"] for n in nodes_doc(f)["nodes"]}
    assert {n for n in now if now[n] != regs[n]} == bad
    assert f.server.alive()
    log = f.server.life_output()
    for n in malformed:
        assert f"closing stream of {n} " in log and "invalid shard_status message" in log
    for n in oversized - malformed:
        assert any(f"closed stream of {n} " in line and "exceeds limit" in line for line in log.splitlines())
    fleet_ready(f, sim, "after the bad messages")


def test_worker_processes_share_out_the_fleet_and_a_dead_one_stops_the_run(tmp_path: Path) -> None:
    """--procs 2: agents in two worker processes, one status; a worker that dies ends the simulator (exit 1).

    With --hold every agent is built and none dials until ``go``: what a benchmark needs to start
    its clock after the simulator's own start."""
    import os
    import signal

    with Fleet(tmp_path, nodes={}, replicas=4, lifecycle=LIFECYCLE) as f:
        f.start(agents=False)
        sock_dir = Path(tempfile.mkdtemp(prefix="fsim-"))
        try:
            argv = [sys.executable, "-m", "llmgw.sim.fleet.cli", "--url", f.stream_url,
                    "--ca-dir", str(f.pki.ca.directory), "--cert-cache", str(tmp_path / "certs"), "--nodes", "20",
                    "--procs", "2", "--prefix", f"fw{f.suffix.replace('-', '')}", "--mix", "pcie-4gpu-nvlink-pairs",
                    "--start-seconds", "0.1", "--status-file", str(tmp_path / "st.json"),
                    "--control", str(sock_dir / "ctl.sock"), "--hold"]
            sim = Proc("fleet-sim", argv, tmp_path / "sim.log", tmp_path)
            f.extra.append(sim.start())
            until(lambda: (sock_dir / "ctl.sock").exists(), "the control socket", WAIT, on_timeout=sim.output)
            held = send_command(str(sock_dir / "ctl.sock"), "stats")
            assert held["held"] == 20 and held["connections"] == 0 and held["connect_errors"] == 0, held
            assert send_command(str(sock_dir / "ctl.sock"), "go")["ok"]
            st = until(lambda: (s := read_json(tmp_path / "st.json")) and s["registered"] == 20 and s,
                       "20 agents registered", WAIT, on_timeout=sim.output)
            workers = [p for p in st["procs"] if not p.get("coordinator")]
            assert len(workers) == 2 and st["nodes"] == 20 and st["procs_total"] == 2 and st["held"] == 0
            assert all(p["pid"] != sim.pid and p["rss_kib"] > 0 for p in workers)
            f.wait_ready(4)
            assert len(send_command(str(sock_dir / "ctl.sock"), "silence n=5")["nodes"]) == 5
            assert until(lambda: (s := read_json(tmp_path / "st.json")) and s["silenced"] == 5, "5 silenced", WAIT)
            os.kill(workers[0]["pid"], signal.SIGKILL)
            assert sim.proc.wait(WAIT) == 1
            assert f"worker process {workers[0]['pid']} exited" in sim.output()
        finally:
            shutil.rmtree(sock_dir, ignore_errors=True)


