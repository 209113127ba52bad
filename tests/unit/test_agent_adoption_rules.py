"""Which processes count as this node's engines (pure rules) and which records are adopted."""

import os
import subprocess

from llmgw.agent import procident
from llmgw.agent.adoption import command_matches, engine_commands, engine_evidence, judge_record
from llmgw.agent.procident import ProcessIdentity
from llmgw.agent.statedir import ShardRecord

VENV_PY = "/opt/llmgw/.venv/bin/python"
CMDS = [("/opt/llmgw/.venv/bin/llmgw-engine-sim",), ("vllm",), ("python", "-m", "sglang.launch_server"),
        (VENV_PY, "-m", "llmgw.sim.engine")]


def test_command_matching():
    assert command_matches(["/usr/local/bin/vllm", "serve", "m"], ("vllm",))
    assert command_matches(["vllm", "serve"], ("vllm",))
    # a console script runs behind its interpreter
    assert command_matches([VENV_PY, "/opt/llmgw/.venv/bin/llmgw-engine-sim", "serve"],
                           ("/opt/llmgw/.venv/bin/llmgw-engine-sim",))
    assert command_matches(["/usr/bin/python3.11", "-m", "sglang.launch_server", "--port", "1"],
                           ("python", "-m", "sglang.launch_server"))
    assert command_matches([VENV_PY, "-m", "llmgw.sim.engine", "serve"], (VENV_PY, "-m", "llmgw.sim.engine"))
    # an absolute configured path matches only itself
    assert not command_matches(["/tmp/other/llmgw-engine-sim", "serve"], ("/opt/llmgw/.venv/bin/llmgw-engine-sim",))
    assert not command_matches([VENV_PY, "-m", "llmgw", "agent"], (VENV_PY, "-m", "llmgw.sim.engine"))
    assert not command_matches(["vllm-tools"], ("vllm",))
    assert not command_matches([], ("vllm",))


def test_bare_interpreters_are_never_engine_commands():
    cmds = engine_commands({"vllm": ["python"], "sglang": ["/usr/bin/python3", "-m", "sglang.launch_server"]})
    assert ("python",) not in cmds
    assert ("/usr/bin/python3", "-m", "sglang.launch_server") in cmds
    assert ("vllm",) in cmds and ("llama-server",) in cmds  # adapter defaults always count


def test_evidence_by_environment_marker():
    why = engine_evidence({"LLMGW_SHARD_ID": "m.p.1-a/r0"}, ["anything"], "node-a", CMDS)
    assert why and "m.p.1-a/r0" in why
    assert engine_evidence({"LLMGW_SHARD_ID": "x/r0", "LLMGW_NODE_ID": "node-a"}, ["x"], "node-a", CMDS)


def test_another_nodes_engine_on_a_shared_host_is_left_alone():
    env = {"LLMGW_SHARD_ID": "x/r0", "LLMGW_NODE_ID": "node-b"}
    assert engine_evidence(env, ["vllm", "serve"], "node-a", CMDS) is None


def test_evidence_by_command_line():
    assert engine_evidence({}, ["/usr/bin/vllm", "serve", "m"], "n", CMDS)
    assert engine_evidence({}, [VENV_PY, "-m", "llmgw.sim.engine", "serve"], "n", CMDS)
    assert engine_evidence({}, ["sleep", "100"], "n", CMDS) is None
    assert engine_evidence({}, [VENV_PY, "-m", "pytest"], "n", CMDS) is None


SPEC = {
    "shard_id": "m.p.1-a/r0", "replica_id": "m.p.1-a",
    "model": {"name": "m", "source": "org/m", "served_name": "m"},
    "profile": {"name": "p", "engine": "vllm", "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                "nodes": 1, "extra_args": [], "env": {}, "start_timeout": 60},
    "rank": 0, "nnodes": 1, "gpu_indices": [0], "env": {},
}


def _rec(ident, spec=SPEC):
    return ShardRecord(spec=spec, state="ready", process=ident)


def test_a_record_whose_spec_could_not_be_reported_is_not_adopted():
    me = procident.identify(os.getpid())
    bad = judge_record(_rec(me, {**SPEC, "rank": -1}))
    assert not bad.adopt and "/rank" in bad.why
    odd = judge_record(ShardRecord(spec=SPEC, state="exploded", process=me))
    assert not odd.adopt and "'exploded'" in odd.why


def test_record_judgement_by_identity():
    me = procident.identify(os.getpid())
    assert judge_record(_rec(me)).adopt
    reused = judge_record(_rec(ProcessIdentity(me.pid, me.start_time + 7, me.boot_id)))
    assert not reused.adopt and "another process" in reused.why
    rebooted = judge_record(_rec(ProcessIdentity(me.pid, me.start_time, "other-boot")))
    assert not rebooted.adopt and "rebooted" in rebooted.why
    assert not judge_record(_rec(None)).adopt
    p = subprocess.Popen(["true"])
    ident = procident.identify(p.pid)
    p.wait()
    gone = judge_record(_rec(ident))
    assert not gone.adopt and "gone" in gone.why
