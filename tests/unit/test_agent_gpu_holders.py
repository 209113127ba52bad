"""A GPU that a process other than this agent's engines uses is not advertised.

Real processes throughout: a ``sleep`` is the foreign holder (another user's
job, a stuck CUDA process: nothing about it says "engine"), and a shell that
leads its own session with ``sleep`` workers is an engine of ours, adopted by
a real ``Supervisor`` from a state record.  The hardware file stands in for
NVML's process lists (``gpus[].processes``, the schema discovery fills in).
What is checked is what the agent advertises (``_Discovery``, the function
that feeds every ``register``), the register message itself, and what the
control plane does with it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from llmgw.agent import procident
from llmgw.agent.adoption import OwnEngines, UnknownEngine, foreign_holders, withhold_foreign_gpus
from llmgw.agent.main import _Discovery, _discover_sync, own_engines
from llmgw.agent.statedir import ShardRecord, StateDir
from llmgw.agent.supervisor import ENV_NODE_ID, ENV_SHARD_ID, Supervisor, SupervisorConfig
from llmgw.config import schema_errors
from llmgw.controlplane.messages import parse_up
from llmgw.controlplane.state import ControlPlane
from llmgw.controlplane.views import nodes_view
from llmgw.hardware.types import GPU, GPUProcess, HardwareInventory
from cp_session import Session, register_message, server_settings

GIB = 1 << 30


@pytest.fixture
def node() -> str:
    return f"node-{os.getpid()}-{random.randrange(1 << 30):x}"


def inventory(node: str, processes: dict[int, list[int]] | None = None, n: int = 4) -> HardwareInventory:
    """``n`` GPUs, all NVLink peers; ``processes``: GPU index -> pids NVML lists (others: none listed)."""
    processes = processes or {}
    return HardwareInventory(node_id=node, gpu_source="simulated", gpus=tuple(
        GPU(i, f"GPU-{node}-{i:02d}", "Simulated H100 80GB", 80 * GIB, f"00000000:{0x10 + i:02X}:00.0",
            nvlink_peers=tuple(j for j in range(n) if j != i),
            processes=tuple(GPUProcess(p, 3 * GIB) for p in processes.get(i, ())))
        for i in range(n)))


class Node:
    """Agent settings over a hardware file the test rewrites, as NVML's answer changes."""

    def __init__(self, tmp: Path, node_id: str):
        from llmgw.settings import parse_agent_settings

        self.node_id = node_id
        self.hw = tmp / "hardware.yaml"
        self.write({})
        self.settings = parse_agent_settings({
            "node_id": node_id,
            "control_plane": {"url": "ws://127.0.0.1:1/v1/agent/stream"},
            "insecure_no_tls": True,
            "state_dir": str(tmp / "state"),
            "discovery": {"gpus": "simulated", "hardware_file": str(self.hw), "sysfs_root": str(tmp / "no-sysfs")},
        })

    def write(self, processes: dict[int, list[int]] | None) -> None:
        doc = inventory(self.node_id, processes or {}).to_dict()
        if processes is None:  # NVML could not say
            for g in doc["gpus"]:
                g.pop("processes")
        self.hw.write_text(yaml.safe_dump(doc))


def spawn(argv: list[str], **env: str) -> subprocess.Popen:
    return subprocess.Popen(argv, env={**os.environ, **env}, start_new_session=True,
                            stdin=subprocess.DEVNULL)


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.kill()
    p.wait()


@pytest.fixture
def foreign():
    """A process using a GPU that is nobody's engine: no marker, no engine command line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    p = subprocess.Popen(["sleep", "100000"], env=env, start_new_session=True, stdin=subprocess.DEVNULL)
    yield p
    stop(p)


def children(pid: int) -> list[int]:
    out = []
    for q in procident.list_pids():
        st = procident.read_stat(q)
        if st is not None and st.ppid == pid:
            out.append(q)
    return sorted(out)


@pytest.fixture
def engine(node):
    """An engine-like process group: a leader in its own session, two workers under it.

    The workers drop the leader's markers, so only their session and group
    say whose they are.
    """
    shard = "tiny.sim.1-own/r0"
    worker = f"env -u {ENV_SHARD_ID} -u {ENV_NODE_ID} sleep 100000"
    p = spawn(["sh", "-c", f"{worker} & {worker} & wait"], **{ENV_SHARD_ID: shard, ENV_NODE_ID: node})
    def sleeping() -> list[int]:
        return [c for c in children(p.pid) if getattr(procident.read_stat(c), "comm", "") == "sleep"]
    while len(sleeping()) < 2:  # the shell forks its workers, which exec env, then sleep
        time.sleep(0.02)
    yield shard, p, children(p.pid)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def nonexistent_pid() -> int:
    """A pid no process can have in this namespace (above pid_max), as a host pid seen from a container."""
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 12345


def advertise(n: Node, own=None, survivors: list[UnknownEngine] | None = None):
    discovery = _Discovery(n.settings, _discover_sync(n.settings), survivors, own=own)
    return discovery, asyncio.run(discovery())


# --- the rule -------------------------------------------------------------------


def test_a_gpu_in_use_by_a_foreign_process_is_withheld_and_the_control_plane_places_elsewhere(
        tmp_path, node, foreign):
    n = Node(tmp_path, node)
    n.write({0: [foreign.pid]})
    _, hw = advertise(n)
    assert [g.index for g in hw.gpus] == [1, 2, 3]
    assert all(0 not in g.nvlink_peers for g in hw.gpus), "no peer points at a withheld GPU"
    assert hw.gpu_reason == f"GPU 0 withheld: in use by pid {foreign.pid} (sleep), not an llmgw engine"
    assert foreign.poll() is None, "never signalled: it is not ours"

    msg = register_message(n.settings, hw)
    assert schema_errors(msg, "stream") == []
    assert parse_up(json.dumps(msg)) == msg
    cp = ControlPlane(server_settings())  # one TP=2 replica
    session = Session()
    cp.register(msg, session)
    cp.tick()
    (start,) = [m for m in session.sent if m["type"] == "start"]
    assert 0 not in start["spec"]["gpu_indices"] and len(start["spec"]["gpu_indices"]) == 2
    (view,) = nodes_view(cp)["nodes"]
    assert view["gpus_total"] == 3
    assert f"GPU 0 withheld: in use by pid {foreign.pid} (sleep)" in view["hardware"]["gpu_reason"]


def test_the_gpu_is_advertised_again_once_discovery_no_longer_lists_the_process(tmp_path, node, foreign, caplog):
    caplog.set_level(logging.WARNING, logger="llmgw.agent.main")
    n = Node(tmp_path, node)
    n.write({0: [foreign.pid]})
    discovery, hw = advertise(n)
    assert [g.index for g in hw.gpus] == [1, 2, 3]
    assert [g.index for g in asyncio.run(discovery()).gpus] == [1, 2, 3], "withheld on every register"
    warned = [r.getMessage() for r in caplog.records if f"pid {foreign.pid} (sleep)" in r.getMessage()]
    assert len(warned) == 1 and "not signalled" in warned[0], "warned once, not on every register"

    stop(foreign)
    n.write({})  # NVML stops listing a process once it has exited
    hw = asyncio.run(discovery())
    assert [g.index for g in hw.gpus] == [0, 1, 2, 3] and hw.gpu_reason is None
    assert any(f"GPU 0: pid {foreign.pid} no longer uses it; advertised again" in r.getMessage()
               for r in caplog.records)


def test_a_pid_not_in_our_namespace_is_not_counted_but_logged_once(tmp_path, node, caplog):
    # Inside a container NVML reports host pids, among them this agent's own engines: counting
    # them would withhold the GPUs its replicas run on.
    caplog.set_level(logging.WARNING, logger="llmgw.agent.main")
    ghost = nonexistent_pid()
    n = Node(tmp_path, node)
    n.write({2: [ghost]})
    discovery, hw = advertise(n)
    assert [g.index for g in hw.gpus] == [0, 1, 2, 3] and hw.gpu_reason is None
    asyncio.run(discovery())
    said = [r.getMessage() for r in caplog.records if f"pid {ghost}" in r.getMessage()]
    assert len(said) == 1 and "pid namespace" in said[0] and "--pid=host" in said[0]


def test_a_listed_process_that_has_exited_withholds_nothing(tmp_path, node, foreign):
    n = Node(tmp_path, node)
    n.write({1: [foreign.pid]})
    discovery, hw = advertise(n)
    assert [g.index for g in hw.gpus] == [0, 2, 3]
    stop(foreign)
    hw = asyncio.run(discovery())  # NVML still lists it for a moment
    assert [g.index for g in hw.gpus] == [0, 1, 2, 3] and hw.gpu_reason is None


def test_unknown_processes_withhold_nothing(tmp_path, node):
    n = Node(tmp_path, node)
    n.write(None)
    _, hw = advertise(n)
    assert all(g.processes is None for g in hw.gpus)
    assert [g.index for g in hw.gpus] == [0, 1, 2, 3] and hw.gpu_reason is None


def test_several_holders_on_one_gpu_and_several_gpus(tmp_path, node, foreign):
    ghost = nonexistent_pid()
    n = Node(tmp_path, node)
    n.write({1: [foreign.pid, ghost], 3: [foreign.pid]})
    _, hw = advertise(n)
    assert [g.index for g in hw.gpus] == [0, 2]
    assert hw.gpu_reason == (
        f"GPU 1 withheld: in use by pid {foreign.pid} (sleep), not an llmgw engine; "
        f"GPU 3 withheld: in use by pid {foreign.pid} (sleep), not an llmgw engine")


# --- what counts as ours --------------------------------------------------------


def test_an_engine_leader_and_its_workers_are_ours(tmp_path, node, engine, foreign):
    shard, leader, workers = engine
    n = Node(tmp_path, node)
    n.write({0: [leader.pid], 1: workers, 2: [workers[0], foreign.pid]})
    own = OwnEngines.of(node, [(shard, procident.identify(leader.pid))])
    for pid in workers:
        st = procident.read_stat(pid)
        assert st.sid == st.pgid == leader.pid  # the group a launched engine is
        assert ENV_SHARD_ID not in procident.read_environ(pid)
    _, hw = advertise(n, own=lambda: own)
    assert [g.index for g in hw.gpus] == [0, 1, 3]
    assert hw.gpu_reason == f"GPU 2 withheld: in use by pid {foreign.pid} (sleep), not an llmgw engine"
    assert [g.processes for g in hw.gpus][:2] == [(GPUProcess(leader.pid, 3 * GIB),),
                                                  tuple(GPUProcess(w, 3 * GIB) for w in workers)]


def test_a_worker_in_a_session_of_its_own_is_ours_by_its_shard_marker(node, engine):
    shard, leader, _ = engine
    detached = spawn(["sleep", "100000"], **{ENV_SHARD_ID: shard, ENV_NODE_ID: node})
    other_node = spawn(["sleep", "100000"], **{ENV_SHARD_ID: shard, ENV_NODE_ID: node + "-b"})
    other_shard = spawn(["sleep", "100000"], **{ENV_SHARD_ID: "tiny.sim.1-x/r0", ENV_NODE_ID: node})
    try:
        own = OwnEngines.of(node, [(shard, procident.identify(leader.pid))])
        assert own.owns(detached.pid)
        assert not own.owns(other_node.pid), "another node's engine on a shared host is not ours"
        assert not own.owns(other_shard.pid), "a shard this agent does not run is not ours"
        inv = inventory(node, {0: [detached.pid], 1: [other_node.pid], 2: [other_shard.pid]})
        assert [(h.gpu, h.pid) for h in foreign_holders(inv, own)] == [(1, other_node.pid), (2, other_shard.pid)]
    finally:
        for p in (detached, other_node, other_shard):
            stop(p)


def test_a_leader_identity_that_no_longer_matches_is_not_ours(node, foreign):
    # A recorded identity whose pid now names another process (start time differs) vouches for nothing.
    stale = procident.ProcessIdentity(foreign.pid, procident.read_stat(foreign.pid).start_time + 1,
                                      procident.boot_id())
    own = OwnEngines.of(node, [("tiny.sim.1-old/r0", stale)])
    assert own.leaders == frozenset()
    out, holders = withhold_foreign_gpus(inventory(node, {0: [foreign.pid]}), own)
    assert [g.index for g in out.gpus] == [1, 2, 3] and [h.pid for h in holders] == [foreign.pid]


def test_engines_the_supervisor_adopted_are_ours(tmp_path, node, engine, foreign):
    """``own_engines`` as the agent wires it: whatever the supervisor runs or adopted, asked each time."""
    shard, leader, workers = engine
    n = Node(tmp_path, node)
    n.write({0: [leader.pid, *workers], 1: [foreign.pid]})
    spec = {
        "shard_id": shard, "replica_id": shard.split("/")[0],
        "model": {"name": "tiny", "source": "org/tiny", "served_name": "tiny"},
        "profile": {"name": "sim", "engine": "vllm", "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                    "nodes": 1, "extra_args": [], "env": {}, "start_timeout": 60},
        "rank": 0, "nnodes": 1, "gpu_indices": [0], "env": {},
    }
    record = ShardRecord(spec=spec, state="ready", process=procident.identify(leader.pid), port=1)

    async def scenario():
        sup = Supervisor(SupervisorConfig.from_settings(n.settings), StateDir(n.settings.state_dir), lambda m: None)
        before = await _Discovery(n.settings, _discover_sync(n.settings),
                                  own=lambda: own_engines(sup, node))()
        sup.adopt(record)
        discovery = _Discovery(n.settings, _discover_sync(n.settings), own=lambda: own_engines(sup, node))
        after = await discovery()
        await sup.detach()
        return before, after

    before, after = asyncio.run(scenario())
    # Before the adoption the engine's own GPU looks held by strangers; after it, only GPU 1 is.
    assert [g.index for g in before.gpus] == [2, 3]
    assert [g.index for g in after.gpus] == [0, 2, 3]
    assert after.gpu_reason == f"GPU 1 withheld: in use by pid {foreign.pid} (sleep), not an llmgw engine"
    assert leader.poll() is None and foreign.poll() is None


def test_a_survivor_and_a_foreign_holder_both_keep_their_gpus_out(tmp_path, node, foreign):
    n = Node(tmp_path, node)
    n.write({3: [foreign.pid]})
    stuck = UnknownEngine(procident.identify(foreign.pid), foreign.pid, "stuck", (), "1")
    _, hw = advertise(n, survivors=[stuck])
    assert [g.index for g in hw.gpus] == [0, 2]
    assert hw.gpu_reason == (f"GPU(s) 1 withheld: held by pid {foreign.pid}, an unidentified engine that "
                             f"survived SIGKILL; GPU 3 withheld: in use by pid {foreign.pid} (sleep), "
                             f"not an llmgw engine")
