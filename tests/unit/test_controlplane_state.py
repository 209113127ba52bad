"""The control plane's glue without sockets: epochs, dispatch, endpoints, reload."""

from __future__ import annotations

import pytest
from cp_state_fakes import Clock, FakeSession, register, settings

from llmgw.config import ConfigInvalid
from llmgw.controlplane.messages import MessageProblem, parse_up
from llmgw.controlplane.state import ControlPlane
from llmgw.settings import parse_server_settings


def test_a_new_registration_supersedes_and_voids_the_old_stream():
    clock = Clock()
    cp = ControlPlane(settings(), clock=clock)
    old, new = FakeSession(), FakeSession()
    e1 = cp.register(register("n1"), old)
    cp.tick()
    (start,) = [m for m in old.sent if m["type"] == "start"]
    sid = start["spec"]["shard_id"]
    e2 = cp.register(register("n1", [{"spec": start["spec"], "state": "starting"}]), new)
    assert e2 > e1 and old.closed and "superseded" in old.closed
    # A late "failed" on the old stream changes nothing...
    assert cp.message("n1", e1, {"type": "shard_status", "shard_id": sid, "state": "failed"}) is False
    cp.disconnected("n1", e1)
    assert cp.nodes["n1"].connected is True and cp.nodes["n1"].epoch == e2
    (r,) = cp.reconciler.book.replicas.values()
    assert r.shards[0].state == "starting"
    # ...while the current stream is heard.
    assert cp.message("n1", e2, {"type": "shard_status", "shard_id": sid, "state": "ready", "port": 20001})
    cp.tick()
    assert r.state.value == "ready"
    assert new.sent == [], "nothing restarted or stopped on reconnect"


def test_endpoints_follow_ready_replicas():
    clock = Clock()
    cp = ControlPlane(settings(), clock=clock)
    seen: list[list[dict]] = []
    cp.on_endpoints(lambda published: seen.append(published.endpoints))
    s = FakeSession()
    e = cp.register(register("n1"), s)
    cp.tick()
    sid = next(m for m in s.sent if m["type"] == "start")["spec"]["shard_id"]
    cp.message("n1", e, {"type": "shard_status", "shard_id": sid, "state": "ready", "port": 20001,
                         "address": "10.0.0.9"})
    cp.tick()
    assert seen[0] == [] and seen[-1][0]["url"] == "http://10.0.0.9:20001"
    assert seen[-1][0]["model"] == "tiny" and seen[-1][0]["draining"] is False
    cp.message("n1", e, {"type": "shard_status", "shard_id": sid, "state": "failed", "reason": "boom"})
    cp.tick()
    assert seen[-1] == []


def test_silence_makes_a_node_unreachable_then_lost_unless_the_whole_fleet_is_silent():
    clock = Clock()
    cp = ControlPlane(settings(replicas=0), clock=clock)
    e1 = cp.register(register("n1"), FakeSession())
    e2 = cp.register(register("n2"), FakeSession())
    cp.disconnected("n1", e1)
    for _ in range(7):
        clock.t += 1
        cp.message("n2", e2, {"type": "heartbeat", "seq": 1})
        cp.tick()
        if clock.t == 1004:
            assert cp.nodes["n1"].clock.state.value == "unreachable"
    assert cp.nodes["n1"].clock.state.value == "lost"
    cp.register(register("n1"), FakeSession())
    assert cp.nodes["n1"].clock.state.value == "ready"
    # Everybody silent at once: unreachable, but nobody is declared lost.
    clock.t += 30
    cp.tick()
    assert {n.clock.state.value for n in cp.nodes.values()} == {"unreachable"}
    assert cp.evaluation.damped


def test_reloaded_settings_apply_and_scale_down_stops_surplus():
    clock = Clock()
    cp = ControlPlane(settings(replicas=1), clock=clock)
    s = FakeSession()
    cp.register(register("n1"), s)
    cp.tick()
    cp.apply_settings(settings(replicas=0), "server.yaml")
    cp.tick()
    assert [m["type"] for m in s.sent] == ["start", "stop"]


@pytest.mark.parametrize("data, needle", [
    (b"\x00", "binary frame"),
    ("[1, 2]", "not a JSON object"),
    ('{"type": "start", "spec": {}}', "not sent by agents"),
    ('{"type": "heartbeat"}', "'seq' is a required property"),
    ('{"type": "shard_status", "shard_id": "a/r0", "state": "done"}', "/state"),
    ("{", "not JSON"),
    ("x" * (4 * 1024 * 1024 + 1), "exceeds"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),  # RecursionError, not ValueError, in json
    # refused before the schema, whose walk over a million items would hold the event loop for seconds
    ('{"type": "progress", "source": "s", "bytes_done": 1, "shard_ids": [' + ", ".join(['"a/r0"'] * 200_000)
     + "]}", "/shard_ids: array of 200000 items; agent messages hold at most 1024"),
    ('{"type": "heartbeat", "seq": 1, "time": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
])
def test_bad_messages_are_refused_with_where_and_why(data, needle):
    with pytest.raises(MessageProblem) as e:
        parse_up(data)
    assert needle in str(e.value)


def test_a_register_that_lists_one_shard_twice_is_refused_naming_both():
    import json

    spec = {"shard_id": "m.p.1-ab/r0", "replica_id": "m.p.1-ab",
            "model": {"name": "m", "source": "org/m", "served_name": "m"},
            "profile": {"name": "p", "engine": "vllm", "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                        "nodes": 1, "extra_args": [], "env": {}, "start_timeout": 60},
            "rank": 0, "nnodes": 1, "gpu_indices": [0], "env": {}}
    report = {"spec": spec, "state": "ready", "process": {"pid": 42, "start_time": 1, "boot_id": "b"}, "port": 8000}
    other = {**report, "spec": {**spec, "shard_id": "m.p.1-cd/r0", "replica_id": "m.p.1-cd"}}
    msg = register("n1", [report, other])  # valid as it is
    msg["shards"].append(report)
    with pytest.raises(MessageProblem, match=r"/shards/2/spec/shard_id 'm.p.1-ab/r0' repeats /shards/0"):
        parse_up(json.dumps(msg))


def test_register_hardware_must_describe_the_registering_node():
    import json

    msg = register("n1")
    msg["hardware"]["node_id"] = "n2"
    with pytest.raises(MessageProblem, match="differs from node_id"):
        parse_up(json.dumps(msg))


def test_server_without_tls_is_refused_unless_insecure_is_explicit(caplog):
    from llmgw.controlplane.server import StartupRefused, tls_context

    doc = {"api": {"listen": {"port": 8443}}, "models": [], "profiles": [], "deployments": []}
    with pytest.raises(ConfigInvalid):
        parse_server_settings(doc)
    s = parse_server_settings({**doc, "insecure_no_tls": True})
    with caplog.at_level("WARNING", logger="llmgw.controlplane"):
        assert tls_context(s) is None
    assert any(r.levelname == "WARNING" and "WITHOUT TLS" in r.getMessage() for r in caplog.records)
    object.__setattr__(s, "insecure_no_tls", False)
    with pytest.raises(StartupRefused, match="require mutual TLS"):
        tls_context(s)


def test_a_large_fleet_is_told_a_longer_heartbeat_and_given_the_same_slack():
    clock = Clock()
    # 2 heartbeats a second for the whole fleet, 1 s configured: from the third node on, the interval grows
    cp = ControlPlane(settings(replicas=0, max_heartbeats_per_second=2), clock=clock)
    assert cp.lifecycle().heartbeat_interval == 1
    for i in range(6):
        cp.register(register(f"n{i}"), FakeSession())
    lc = cp.lifecycle()
    assert (lc.heartbeat_interval, lc.unreachable_after, lc.lost_after) == (3.0, 5.0, 8.0)
    # silent for longer than the configured unreachable_after (3 s) but within the stretched 5 s: still ready
    clock.t += 4.5
    cp.tick()
    assert {rec.clock.state.value for rec in cp.nodes.values()} == {"ready"}
    clock.t += 1.0
    cp.tick()
    assert {rec.clock.state.value for rec in cp.nodes.values()} == {"unreachable"}

