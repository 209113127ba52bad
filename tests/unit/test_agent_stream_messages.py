"""What the agent accepts from the control plane and what its register says."""

import asyncio
import os
from pathlib import Path

import pytest
from stream_messages import SPEC

from llmgw.agent import procident
from llmgw.agent.statedir import ShardRecord, StateDir
from llmgw.agent.stream import StreamClient, incoming_problems
from llmgw.agent.supervisor import Supervisor, SupervisorConfig
from llmgw.config import schema_errors
from llmgw.hardware.simulated import inventory_from_document, read_hardware_document

HW = Path(__file__).resolve().parents[1] / "fixtures" / "hardware" / "pcie-4gpu-nvlink-pairs.yaml"


@pytest.mark.parametrize("msg", [
    {"type": "registered", "epoch": 3, "heartbeat_interval": 5},
    {"type": "start", "spec": SPEC},
    {"type": "stop", "shard_id": "m.p.1-ab/r0", "reason": "model left the catalog"},
    {"type": "drain", "shard_id": "m.p.1-ab/r0"},
    {"type": "error", "reason": "certificate CN does not match"},
])
def test_valid_downstream_messages(msg):
    assert incoming_problems(msg) == []


@pytest.mark.parametrize("msg, expect", [
    ([1, 2], "not a JSON object"),
    ({"type": "heartbeat", "seq": 1}, "is not sent to agents"),
    ({"type": "register"}, "is not sent to agents"),
    ({"type": "reboot"}, "is not sent to agents"),
    ({"type": "start", "spec": {**SPEC, "gpu_indices": [0, 0]}}, "non-unique"),
    ({"type": "stop"}, "shard_id"),
    ({"type": "registered", "epoch": 0, "heartbeat_interval": 5}, "minimum"),
    ({"type": "drain", "shard_id": "x/r0", "now": True}, "'now' was unexpected"),
])
def test_invalid_downstream_messages_say_why(msg, expect):
    problems = incoming_problems(msg)
    assert problems and any(expect in p for p in problems), problems


def test_register_carries_hardware_and_every_shard_and_passes_the_schema(tmp_path):
    inv = inventory_from_document(read_hardware_document(HW), node_id="gpu-n1", fabrics=())
    me = procident.identify(os.getpid())  # a live process stands in for an engine record

    async def main():
        sd = StateDir(tmp_path)
        cfg = SupervisorConfig(node_id="gpu-n1", advertise_address="10.0.0.7", engine_bind_host="0.0.0.0",
                               engine_ports=(20000, 20010), engine_commands={}, model_dir=str(tmp_path))
        sup = Supervisor(cfg, sd, lambda m: None)
        sup.adopt(ShardRecord(spec=SPEC, state="ready", process=me, port=20003, started_at=1.0))
        client = StreamClient(url="wss://cp:8443/v1/agent/stream", node_id="gpu-n1", address="10.0.0.7",
                              ssl_context=None, supervisor=sup, discover=None, reconnect_initial=1, reconnect_max=2)
        reg = client.register_message(inv)
        await sup.detach()
        return reg

    reg = asyncio.run(main())
    assert schema_errors(reg, "stream") == []
    assert reg["node_id"] == "gpu-n1" and reg["boot_id"] == me.boot_id
    assert len(reg["hardware"]["gpus"]) == 4
    (shard,) = reg["shards"]
    assert shard == {"spec": SPEC, "state": "ready", "adopted": True, "started_at": 1.0,
                     "process": me.to_dict(), "port": 20003, "address": "10.0.0.7"}
    assert procident.is_running(me)  # detaching never signals an engine


def test_the_grant_is_kept_with_the_shard_and_presented_in_register_and_shard_status(tmp_path):
    from llmgw.controlplane.grants import GrantKeys, issue

    grant = issue(GrantKeys((b"g" * 32,)), replica_id="m.p.1-ab", slot=1, model="m", profile="p", node_id="gpu-n1",
                  rank=0, nnodes=1, issued_at=1.7e9, cp_epoch=3, nonce="cd" * 16)
    spec = {**SPEC, "grant": grant}
    assert incoming_problems({"type": "start", "spec": spec}) == []
    me = procident.identify(os.getpid())

    async def main():
        sd = StateDir(tmp_path)
        cfg = SupervisorConfig(node_id="gpu-n1", advertise_address="10.0.0.7", engine_bind_host="0.0.0.0",
                               engine_ports=(20000, 20010), engine_commands={}, model_dir=str(tmp_path))
        sup = Supervisor(cfg, sd, lambda m: None)
        sd.write(ShardRecord(spec=spec, state="ready", process=me, port=20003, started_at=1.0))
        (record,), unreadable = StateDir(tmp_path).load()  # what a restarted agent reads back
        assert unreadable == []
        shard = sup.adopt(record)
        out = (sup.report(shard), sup.status_message(shard))
        await sup.detach()
        return out

    report, status = asyncio.run(main())
    assert report["spec"]["grant"] == grant, "kept in the shard record across an agent restart"
    assert status["grant"] == grant
    assert schema_errors({"type": "shard_status", **{k: v for k, v in status.items() if k != "type"}},
                         "stream") == []
