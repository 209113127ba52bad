"""An unidentified engine that survives SIGKILL keeps its GPUs out of what the node advertises.

A real process stands in for the engine (its environment carries this node's
markers and a ``CUDA_VISIBLE_DEVICES``); the only fake is at the kill
boundary, ``adoption._signal_unknown``, which records the signals instead of
sending them: that is what a process in uninterruptible sleep looks like
from the agent's side (signalled, still there).  Everything after it is the
agent's real code: recovery, discovery, the register message, and the
control plane's own handling of that message.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from cp_session import Session, register_message, server_settings

from llmgw.agent import adoption, procident
from llmgw.agent.adoption import UnknownEngine, held_gpu_indices, recover, withhold_gpus
from llmgw.agent.main import _Discovery, _discover_sync
from llmgw.agent.statedir import StateDir
from llmgw.agent.supervisor import ENV_NODE_ID, ENV_SHARD_ID
from llmgw.config import schema_errors
from llmgw.controlplane.messages import parse_up
from llmgw.controlplane.state import ControlPlane
from llmgw.controlplane.views import nodes_view
from llmgw.hardware.types import GPU, HardwareInventory
from llmgw.settings import parse_agent_settings

GIB = 1 << 30


def inventory(node: str, n: int = 4) -> HardwareInventory:
    return HardwareInventory(node_id=node, gpu_source="simulated", gpus=tuple(
        GPU(i, f"GPU-{node}-{i:02d}", "Simulated H100 80GB", 80 * GIB, f"00000000:{0x10 + i:02X}:00.0",
            nvlink_peers=tuple(j for j in range(n) if j != i)) for i in range(n)))


def agent_settings(tmp: Path, node: str):
    hw = tmp / "hardware.yaml"
    hw.write_text(yaml.safe_dump(inventory(node).to_dict()))
    return parse_agent_settings({
        "node_id": node,
        "control_plane": {"url": "ws://127.0.0.1:1/v1/agent/stream"},
        "insecure_no_tls": True,
        "state_dir": str(tmp / "state"),
        "discovery": {"gpus": "simulated", "hardware_file": str(hw), "sysfs_root": str(tmp / "no-sysfs")},
    })


def spawn_sleep(env: dict[str, str]) -> subprocess.Popen:
    """``sleep`` with ``env``, returned once its exec is complete: Popen returns while the kernel
    may still show the parent's (or an empty) environment, which no scan can tell from a
    process that is not an engine."""
    p = subprocess.Popen(["sleep", "100000"], env=env, start_new_session=True)
    deadline = time.monotonic() + 10
    while (procident.read_cmdline(p.pid) != ["sleep", "100000"]
           or ENV_NODE_ID not in (procident.read_environ(p.pid) or {})):
        assert time.monotonic() < deadline, f"pid {p.pid} did not finish exec"
        time.sleep(0.001)
    return p


@pytest.fixture
def node() -> str:
    return f"node-{os.getpid()}-{random.randrange(1 << 30):x}"


@pytest.fixture
def stuck(node):
    """A process this node's agent takes for an unidentified engine that can see GPUs 1 and 2."""
    env = {**os.environ, ENV_SHARD_ID: "ghost.sim.1-st/r0", ENV_NODE_ID: node, "CUDA_VISIBLE_DEVICES": "1,2"}
    p = spawn_sleep(env)
    yield p
    p.kill()
    p.wait()


@pytest.fixture
def signals_do_not_kill(monkeypatch):
    """The kill boundary: record each signal the agent sends and let the process live on."""
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(adoption, "_signal_unknown", lambda e, sig: sent.append((e.identity.pid, sig)))
    return sent


def recover_now(settings) -> adoption.RecoveryResult:
    return asyncio.run(recover(StateDir(settings.state_dir), settings.node_id, settings.engine_commands,
                               kill_grace=0.2, kill_wait=0.5))


def test_gpus_of_an_engine_that_survives_sigkill_are_not_advertised_and_the_control_plane_sees_why(
        tmp_path, node, stuck, signals_do_not_kill):
    settings = agent_settings(tmp_path, node)
    result = recover_now(settings)

    (survivor,) = [e for e in result.survivors if e.identity.pid == stuck.pid]
    assert survivor not in result.killed
    assert [s for p, s in signals_do_not_kill if p == stuck.pid] == [signal.SIGTERM, signal.SIGKILL]
    assert survivor.visible_devices == "1,2"
    assert stuck.poll() is None

    discovery = _Discovery(settings, _discover_sync(settings), [survivor])
    hw = asyncio.run(discovery())
    assert [g.index for g in hw.gpus] == [0, 3]
    assert all(set(g.nvlink_peers) <= {0, 3} for g in hw.gpus), "no peer points at a withheld GPU"
    assert f"GPU(s) 1, 2 withheld: held by pid {stuck.pid}" in hw.gpu_reason
    assert "survived SIGKILL" in hw.gpu_reason

    msg = register_message(settings, hw)
    assert schema_errors(msg, "stream") == []
    assert parse_up(json.dumps(msg)) == msg
    assert f"pid {stuck.pid}" in msg["hardware"]["gpu_reason"]

    # The control plane takes that register at its word: a TP=2 replica goes on 0+3, never on 1 or 2.
    cp = ControlPlane(server_settings())
    session = Session()
    cp.register(msg, session)
    cp.tick()
    (start,) = [m for m in session.sent if m["type"] == "start"]
    assert sorted(start["spec"]["gpu_indices"]) == [0, 3]
    (view,) = nodes_view(cp)["nodes"]
    assert view["gpus_total"] == 2 and f"held by pid {stuck.pid}" in view["hardware"]["gpu_reason"]


def test_once_the_survivor_is_gone_the_next_register_advertises_its_gpus_again(
        tmp_path, node, stuck, signals_do_not_kill):
    settings = agent_settings(tmp_path, node)
    (survivor,) = [e for e in recover_now(settings).survivors if e.identity.pid == stuck.pid]
    discovery = _Discovery(settings, _discover_sync(settings), [survivor])
    assert [g.index for g in asyncio.run(discovery()).gpus] == [0, 3]
    stuck.kill()
    stuck.wait()
    hw = asyncio.run(discovery())
    assert [g.index for g in hw.gpus] == [0, 1, 2, 3] and hw.gpu_reason is None
    assert discovery.survivors == []


def test_a_survivor_that_sees_every_gpu_leaves_the_node_with_none_and_says_so(tmp_path, node, signals_do_not_kill):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update({ENV_SHARD_ID: "ghost.sim.1-all/r0", ENV_NODE_ID: node})
    p = spawn_sleep(env)
    try:
        settings = agent_settings(tmp_path, node)
        (survivor,) = [e for e in recover_now(settings).survivors if e.identity.pid == p.pid]
        assert survivor.visible_devices is None
        hw = asyncio.run(_Discovery(settings, _discover_sync(settings), [survivor])())
        assert hw.gpus == () and f"GPU(s) 0, 1, 2, 3 withheld: held by pid {p.pid}" in hw.gpu_reason
        msg = register_message(settings, hw)
        assert schema_errors(msg, "stream") == []
        cp = ControlPlane(server_settings())
        session = Session()
        cp.register(msg, session)
        cp.tick()
        assert [m for m in session.sent if m["type"] == "start"] == []
    finally:
        p.kill()
        p.wait()


def test_killed_engines_withhold_nothing(tmp_path, node):
    # The real kill path: the same kind of process dies, nothing is withheld.
    env = {**os.environ, ENV_SHARD_ID: "ghost.sim.1-k/r0", ENV_NODE_ID: node, "CUDA_VISIBLE_DEVICES": "0"}
    p = spawn_sleep(env)
    try:
        settings = agent_settings(tmp_path, node)
        result = recover_now(settings)
        assert p.pid in [e.identity.pid for e in result.killed]
        assert p.pid not in [e.identity.pid for e in result.survivors]
        assert p.wait(30) == -signal.SIGTERM
        hw = asyncio.run(_Discovery(settings, _discover_sync(settings), result.survivors)())
        assert len(hw.gpus) == 4 and hw.gpu_reason is None
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("visible,held", [
    (None, {0, 1, 2, 3}),  # unset: it sees them all
    ("", set()),
    ("2", {2}),
    ("3,0", {0, 3}),
    ("0,-1,2", {0}),  # CUDA stops at a negative index
    ("GPU-n-01", {1}),
    ("GPU-n-02,1", {1, 2}),
    ("7", {0, 1, 2, 3}),  # not a GPU of this node: cannot tell which, so all
    ("GPU-n-0", {0, 1, 2, 3}),  # an ambiguous UUID prefix
    ("MIG-4f2a", {0, 1, 2, 3}),
])
def test_which_gpus_a_process_can_be_using(visible, held):
    assert held_gpu_indices(visible, inventory("n")) == held


def test_withholding_keeps_an_existing_reason_and_merges_pids():
    inv = HardwareInventory(node_id="n", gpu_source="simulated", gpus=inventory("n").gpus, gpu_reason="earlier")
    ident = procident.ProcessIdentity
    a = UnknownEngine(ident(101, 1, "b"), 101, "x", (), "0")
    b = UnknownEngine(ident(202, 1, "b"), 202, "y", (), "0,1")
    out = withhold_gpus(inv, [a, b])
    assert [g.index for g in out.gpus] == [2, 3]
    assert out.gpu_reason.startswith("earlier; ")
    assert "GPU(s) 0 withheld: held by pid 101" in out.gpu_reason
    assert "GPU(s) 0, 1 withheld: held by pid 202" in out.gpu_reason
    assert withhold_gpus(inv, []) is inv


def test_a_process_caught_inside_execve_is_looked_at_again(monkeypatch, node):
    """Just after exec's close-on-exec step (when Popen returns) a process has its new name but,
    for a moment, an empty command line: seen here 2 times in 300 spawns on a loaded machine."""
    env = {**os.environ, ENV_SHARD_ID: "ghost.sim.1-x/r0", ENV_NODE_ID: node}
    p = subprocess.Popen(["sleep", "100000"], env=env, start_new_session=True)
    real = procident.read_cmdline
    seen: set[int] = set()

    def mid_exec_once(pid: int, *a):
        if pid == p.pid and pid not in seen:
            seen.add(pid)
            return []
        return real(pid, *a)

    monkeypatch.setattr(procident, "read_cmdline", mid_exec_once)
    try:
        found = adoption.find_unknown_engines(node, adoption.engine_commands({}), [])
        assert p.pid in seen and [e.identity.pid for e in found] == [p.pid]
    finally:
        p.kill()
        p.wait()
