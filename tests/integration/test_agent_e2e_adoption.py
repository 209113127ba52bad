"""Adoption and recovery through real processes: ``llmgw server`` + ``llmgw agent`` + simulator engines.

The same guarantees test_agent_process.py proves against a recording control
plane inside pytest, here with the real reconciler deciding what runs, over
real mutual TLS:

* an agent SIGKILLed ten times leaves its engine untouched (every process of
  the engine's group keeps its pid and start time), the control plane keeps
  the same replica on the same process, and a later stop kills the whole
  group, not only its leader;
* a state record whose pid now belongs to an unrelated process never gets
  that process signalled;
* an engine nothing describes is dead before the control plane places
  anything on the GPUs it held: the engine the control plane's start
  launches checks, as its first act, whether the old one still exists.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from llmgw.agent import procident
from llmgw.agent.procident import ProcessIdentity
from llmgw.agent.statedir import ShardRecord, StateDir

from fleet import Fleet, free_port, until

pytestmark = pytest.mark.integration


# ---------------------------------------------------------------------- helpers

def group(pgid: int) -> set[tuple[int, int]]:
    """(pid, start time) of every live process in process group ``pgid``."""
    out = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        st = procident.read_stat(int(entry))
        if st is not None and st.pgid == pgid and st.state not in ("Z", "X"):
            out.add((int(entry), st.start_time))
    return out


def set_agent(f: Fleet, name: str, **changes) -> None:
    """Rewrite one agent's agent.yaml (before it starts)."""
    path = f.root / name / "agent.yaml"
    doc = yaml.safe_load(path.read_text())
    doc.update(changes)
    path.write_text(yaml.safe_dump(doc))


def engine_with_worker(f: Fleet) -> str:
    """The fleet's simulator behind a shell that first leaves a worker in the engine's group (as vLLM does)."""
    w = f.root / "engine-with-worker"
    w.write_text(f"#!/bin/sh\nsleep 100000 &\necho \"worker pid $!\"\nexec {f.sim} \"$@\"\n")
    w.chmod(0o755)
    return str(w)


def node_of(f: Fleet, name: str) -> dict:
    return f.nodes().get(f.node_ids[name]) or {}


def registrations(f: Fleet, name: str) -> int:
    doc = f.try_get("/v1/nodes")
    if doc is None:
        return 0
    return next((n["registrations"] for n in doc["nodes"] if n["node_id"] == f.node_ids[name]), 0)


STRANGER = r"""
import signal, sys, time
out = sys.argv[1]
def note(sig, frame):
    with open(out, "a") as f:
        f.write(f"{sig}\n")
for s in signal.valid_signals():
    if s not in (signal.SIGKILL, signal.SIGSTOP):
        try:
            signal.signal(s, note)
        except (OSError, ValueError, RuntimeError):
            pass
with open(out + ".ready", "w") as f:
    f.write("ready\n")
while True:
    time.sleep(3600)
"""


def make_spec(shard_id: str, gpus=(0,)) -> dict:
    return {
        "shard_id": shard_id, "replica_id": shard_id.split("/")[0],
        "model": {"name": "tiny", "source": "org/tiny", "served_name": "tiny"},
        "profile": {"name": "sim", "engine": "vllm", "tensor_parallel_size": len(gpus), "pipeline_parallel_size": 1,
                    "nodes": 1, "extra_args": [], "env": {}, "start_timeout": 60},
        "rank": 0, "nnodes": 1, "gpu_indices": list(gpus), "env": {},
    }


# ------------------------------------------------------------------------ tests

def test_agent_sigkilled_ten_times_under_the_real_control_plane_keeps_its_engine_and_a_stop_kills_the_whole_group(
        tmp_path):
    with Fleet(tmp_path, nodes={"a": 1}, replicas=1) as f:
        set_agent(f, "a", engines={"vllm": [engine_with_worker(f)]})
        f.start()
        (rep,) = f.wait_ready(1)
        (shard,) = rep["shards"]
        engine = ProcessIdentity.from_dict(shard["process"])
        members = group(engine.pid)
        assert (engine.pid, engine.start_time) in members
        assert len(members) >= 2, f"the engine's group should hold the engine and its worker: {members}"
        agent = f.agents["a"]

        for life in range(1, 11):
            before = registrations(f, "a")
            agent.kill()
            assert group(engine.pid) == members, f"SIGKILL #{life} of the agent touched its engine's group"
            agent.start()
            until(lambda: registrations(f, "a") > before, f"re-registration after SIGKILL #{life}",
                  on_timeout=f.dump)
            (again,) = f.wait_ready(1)
            assert again["replica_id"] == rep["replica_id"], "the control plane kept the same replica"
            (s,) = again["shards"]
            assert s["process"] == engine.to_dict() and s["adopted"] is True, s
            assert group(engine.pid) == members, f"the engine's group changed across agent life {life + 1}"
            assert f"adopted pid {engine.pid}" in agent.life_output()
        assert registrations(f, "a") == 11
        log = (f.root / "a" / "state" / "logs").glob("*.log")
        assert sum(p.read_text(errors="replace").count(f"adopted engine pid {engine.pid}") for p in log) == 10
        assert "stopping" not in f.server.output(10**7), "the control plane never stopped the adopted engine"

        # The catalog stops asking for it: the control plane's stop must reach every process of the group.
        f.config["deployments"] = []
        f.write_config()
        f.server.signal(signal.SIGHUP)
        until(lambda: not group(engine.pid), "every process of the adopted engine's group to be gone",
              on_timeout=lambda: f"{group(engine.pid)}\n{f.dump()}")
        for pid, start in members:  # dead (a zombie at most: nobody may reap an orphan in a container)
            assert not procident.is_running(ProcessIdentity(pid, start, engine.boot_id)), \
                f"pid {pid} of the engine's group survived the stop"
        until(lambda: f.replicas()["replicas"] == [], "the replica gone", on_timeout=f.dump)
        until(lambda: StateDir(f.root / "a" / "state").load() == ([], []), "the record removed", on_timeout=f.dump)
        assert agent.alive() and f.server.alive()


def test_a_record_whose_pid_belongs_to_an_unrelated_process_never_gets_it_signalled_under_the_real_control_plane(
        tmp_path):
    signals = tmp_path / "stranger-signals"
    stranger = subprocess.Popen([sys.executable, "-c", STRANGER, str(signals)], start_new_session=True,
                                stdin=subprocess.DEVNULL)
    try:
        until(lambda: Path(str(signals) + ".ready").exists() or stranger.poll() is not None, "the stranger up")
        real = procident.identify(stranger.pid)
        assert real is not None
        with Fleet(tmp_path / "fleet", nodes={"a": 1}, replicas=1) as f:
            # What the state dir holds after the engine died while no agent ran and its pid was reused.
            sd = StateDir(f.root / "a" / "state")
            stale = "tiny.sim.1-stale/r0"
            sd.write(ShardRecord(spec=make_spec(stale), state="ready",
                                 process=ProcessIdentity(real.pid, real.start_time - 1, real.boot_id),
                                 port=free_port(), address="127.0.0.1", started_at=time.time()))
            f.start()
            (rep,) = f.wait_ready(1)
            # The control plane placed on the GPU the stale record named, through the same agent.
            assert rep["shards"][0]["node_id"] == f.node_ids["a"] and rep["shards"][0]["gpus"] == [0]
            assert rep["shards"][0]["shard_id"] != stale and rep["shards"][0]["adopted"] is False
            out = f.agents["a"].output(10**7)
            assert f"pid {real.pid} now belongs to another process" in out and "not signalled" in out
            assert "1 record(s) removed" in out
            records, _ = sd.load()
            assert [r.shard_id for r in records] == [rep["shards"][0]["shard_id"]]
            assert node_of(f, "a")["registrations"] == 1
            # Another agent life judges the (gone) record again and still leaves the stranger be.
            f.agents["a"].kill()
            f.agents["a"].start()
            until(lambda: registrations(f, "a") == 2, "the agent back", on_timeout=f.dump)
            f.wait_ready(1)
        assert stranger.poll() is None and procident.is_same_process(real)
        assert procident.read_stat(stranger.pid).state in ("S", "R"), "the stranger was stopped"
        assert not signals.exists(), f"the stranger got signals: {signals.read_text()}"
    finally:
        stranger.kill()
        stranger.wait()


def test_an_unidentified_engine_holding_the_nodes_gpu_is_dead_before_the_control_plane_places_on_it(tmp_path):
    with Fleet(tmp_path, nodes={"a": 1}, replicas=1) as f:
        node = f.node_ids["a"]
        # The ghost: launched for this node by an earlier agent (its markers say so), its record lost,
        # still serving and holding the node's only GPU.
        port = free_port()
        ghost_env = {**os.environ, "LLMGW_SHARD_ID": "ghost.sim.1-gh/r0", "LLMGW_NODE_ID": node,
                     "CUDA_VISIBLE_DEVICES": "0"}
        with open(tmp_path / "ghost.log", "wb") as log:
            ghost = subprocess.Popen([str(f.sim), "serve", "ghost", "--host", "127.0.0.1", "--port", str(port)],
                                     env=ghost_env, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            def healthy() -> bool:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                        return r.status == 200
                except OSError:
                    return False
            until(healthy, "the ghost engine serving", on_timeout=lambda: (tmp_path / "ghost.log").read_text())
            ghost_ident = procident.identify(ghost.pid)
            # Every engine the control plane has this node launch first writes down what the ghost's pid
            # is at that instant.  The ghost is this test's child and is not reaped until the end, so its
            # pid cannot be reused: "Z" means dead, anything else means it was still there.
            seen = tmp_path / "ghost-state-at-launch"
            wrapper = tmp_path / "engine-checking-the-ghost"
            wrapper.write_text(
                "#!/bin/sh\n"
                f"st=$(sed 's/.*) //' /proc/{ghost.pid}/stat 2>/dev/null | cut -d' ' -f1)\n"
                f"echo \"${{st:-gone}}\" >> {seen}\n"
                f"exec {f.sim} \"$@\"\n")
            wrapper.chmod(0o755)
            set_agent(f, "a", engines={"vllm": [str(wrapper)]})
            f.start()

            (rep,) = f.wait_ready(1)
            (s,) = rep["shards"]
            assert s["node_id"] == node and s["gpus"] == [0], "placed on the GPU the ghost held"
            states = seen.read_text().split()
            assert states and all(st == "Z" for st in states), \
                f"an engine was launched on the node while the ghost was still alive ({states})"
            assert ghost.poll() is not None  # reaps it now
            assert not procident.is_same_process(ghost_ident)
            n = f.nodes()[node]
            assert n["registrations"] == 1 and n["gpus_total"] == 1
            assert "withheld" not in json.dumps(n["hardware"])
            out = f.agents["a"].output(10**7)
            killing = out.index(f"killing unidentified engine pid {ghost.pid}: launched for shard ghost.sim.1-gh/r0")
            assert killing < out.index("connected to"), "killed before the agent even dialled"
            assert "1 unidentified engine(s) killed" in out
        finally:
            if ghost.poll() is None:
                os.killpg(ghost.pid, signal.SIGKILL)
                ghost.wait()
