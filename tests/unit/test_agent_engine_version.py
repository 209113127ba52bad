"""The engine's release, as rank 0 reports it: parsed per engine, kept across an agent restart."""

import asyncio
import json
import os

import pytest
from stream_messages import SPEC

from llmgw.agent import procident
from llmgw.agent.probe import version_from
from llmgw.agent.statedir import ShardRecord, StateDir
from llmgw.agent.stream import incoming_problems
from llmgw.agent.supervisor import Supervisor, SupervisorConfig
from llmgw.config import schema_errors


@pytest.mark.parametrize("engine, body, version", [
    ("vllm", {"version": "0.33.0"}, "0.33.0"),
    ("sglang", {"version": "0.5.23", "tp_size": 1, "internal_states": [{}]}, "0.5.23"),
    ("llamacpp", {"build_info": "b7100-1a2b3c4", "total_slots": 4}, "b7100-1a2b3c4"),
    ("vllm", {"version": "  0.33.0\n"}, "0.33.0"),
    ("vllm", {"version": "x" * 1000}, "x" * 256),
])
def test_each_engines_answer_gives_its_version(engine, body, version):
    assert version_from(engine, json.dumps(body)) == version


@pytest.mark.parametrize("engine, body", [
    ("vllm", "not json"),
    ("vllm", json.dumps(["0.33.0"])),
    ("vllm", json.dumps({"version": 33})),
    ("vllm", json.dumps({"version": ""})),
    ("vllm", json.dumps({"version": "0.33\x1b[2J"})),  # nothing an operator's terminal would run
    ("llamacpp", json.dumps({"version": "0.33.0"})),  # llama-server's field is build_info
    ("trt", json.dumps({"version": "1"})),
])
def test_an_answer_without_a_usable_version_gives_none(engine, body):
    assert version_from(engine, body) is None


def test_the_version_is_recorded_and_sent_only_to_a_control_plane_that_accepts_it(tmp_path):
    me = procident.identify(os.getpid())  # a live process stands in for the engine
    sent: list[dict] = []

    async def main():
        cfg = SupervisorConfig(node_id="gpu-n1", advertise_address="10.0.0.7", engine_bind_host="0.0.0.0",
                               engine_ports=(20000, 20010), engine_commands={}, model_dir=str(tmp_path))
        first = Supervisor(cfg, StateDir(tmp_path), lambda m: None)
        shard = first.adopt(ShardRecord(spec=SPEC, state="ready", process=me, port=20003, started_at=1.0))
        shard.engine_version = "0.33.0"
        first._persist(shard)
        await first.detach()
        (record,), _ = StateDir(tmp_path).load()  # what a restarted agent reads back
        second = Supervisor(cfg, StateDir(tmp_path), sent.append)
        adopted = second.adopt(record)
        sent.clear()
        # A control plane that predates the field (agents upgrade first) is never sent it.
        older = second.status_message(adopted)
        second.accept_fields(())
        assert sent == []
        # One that names it gets the Ready shard's version at once (its register carried none).
        second.accept_fields(["engine_version"])
        await second.detach()
        return older

    older = asyncio.run(main())
    assert "engine_version" not in older and schema_errors(older, "stream") == []
    (status,) = sent
    assert (status["type"], status["state"], status["engine_version"]) == ("shard_status", "ready", "0.33.0")
    assert schema_errors(status, "stream") == []


def test_accepts_is_a_downstream_message_the_agent_knows():
    assert incoming_problems({"type": "accepts", "shard_status": ["engine_version"]}) == []
    assert incoming_problems({"type": "accepts", "shard_status": "engine_version"})
