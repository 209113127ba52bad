"""Several control planes seen from an agent and a router: whom to dial next, whom to obey."""

from __future__ import annotations

import json

import pytest

from llmgw.agent.controlplanes import Addresses, DeposedLeader, LeaderFence, leader_hint
from llmgw.agent.stream import StreamClient, incoming_problems
from llmgw.router.watch import LeaderTerms, WatchError
from llmgw.settings import parse_agent_settings

from stream_messages import SPEC

CP1, CP2, CP3 = (f"wss://cp{i}:8443/v1/agent/stream" for i in (1, 2, 3))


def test_one_url_is_always_the_one_dialled():
    a = Addresses(CP1)
    assert a.current == CP1 and a.next_after_failure() == CP1 and a.next_after_failure("https://cp9:1") == CP1


def test_after_a_failure_the_next_is_dialled_or_the_leader_a_standby_named():
    a = Addresses([CP1, CP2, CP3])
    assert a.next_after_failure() == CP2
    assert a.next_after_failure() == CP3
    assert a.next_after_failure() == CP1
    assert a.next_after_failure("https://cp3:8443") == CP3, "the leader's admin URL names its host and port"
    assert a.next_after_failure("https://elsewhere:8443") == CP1, "a leader that is not ours: just the next"


def test_a_lower_leader_term_is_refused_and_no_term_passes():
    fence = LeaderFence()
    fence.admit({"type": "registered", "epoch": 1, "heartbeat_interval": 1})  # no ha: no term, no fence
    fence.admit({"type": "registered", "epoch": 9, "heartbeat_interval": 1, "leader_epoch": 40})
    fence.admit({"type": "stop", "shard_id": "x/r0", "leader_epoch": 40})
    with pytest.raises(DeposedLeader, match="term 12; term 40 leads now"):
        fence.admit({"type": "start", "spec": {}, "leader_epoch": 12})
    assert fence.highest == 40


class NoSupervisor:
    def start(self, spec):  # pragma: no cover - must not be reached
        raise AssertionError("a deposed leader's start was acted on")


def test_the_stream_client_drops_a_stream_from_a_deposed_leader_before_acting():
    client = StreamClient(url=[CP1, CP2], node_id="n1", address="10.0.0.7", ssl_context=None,
                          supervisor=NoSupervisor(), discover=None, reconnect_initial=1, reconnect_max=2)
    assert client.url == CP1
    client._handle_text(json.dumps({"type": "registered", "epoch": 5, "heartbeat_interval": 1, "leader_epoch": 7}))
    msg = {"type": "start", "spec": SPEC, "leader_epoch": 3}
    assert incoming_problems(msg) == []
    with pytest.raises(DeposedLeader):
        client._handle_text(json.dumps(msg))
    assert incoming_problems({"type": "registered", "epoch": 1, "heartbeat_interval": 1, "leader_epoch": 0})


def test_a_refusal_names_the_leader_for_the_next_dial():
    class Refused(Exception):
        headers = {"X-Llmgw-Leader": "https://cp2:8443"}

    assert leader_hint(Refused()) == "https://cp2:8443"
    assert leader_hint(OSError("refused")) is None


def test_router_refuses_a_watch_answer_from_a_lower_term():
    terms = LeaderTerms()
    terms.admit(None)
    terms.admit("8")
    with pytest.raises(WatchError, match="deposed"):
        terms.admit("3")
    with pytest.raises(WatchError, match="not an integer"):
        terms.admit("x")


def test_agent_yaml_takes_one_url_or_a_list_with_pointers():
    doc = {"node_id": "n1", "control_plane": {"url": CP1}, "insecure_no_tls": False,
           "tls": {"ca": "ca", "cert": "c", "key": "k"}, "state_dir": "/tmp/s"}
    assert parse_agent_settings(doc).control_plane_urls == (CP1,)
    many = parse_agent_settings({**doc, "control_plane": {"url": [CP1, CP2]}})
    assert many.control_plane_urls == (CP1, CP2) and many.control_plane_url == CP1
    from llmgw.config import ConfigInvalid

    with pytest.raises(ConfigInvalid, match="/control_plane/url/1: ws:// is plaintext"):
        parse_agent_settings({**doc, "control_plane": {"url": [CP1, "ws://cp2:8443/v1/agent/stream"]}})
