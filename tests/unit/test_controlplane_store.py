"""The control plane's store: cordons, drains and epochs outlive the process; nothing half-written."""

from __future__ import annotations

import json
import os
import stat

import pytest

from llmgw.controlplane.state import ControlPlane
from llmgw.controlplane.store import (EPOCH_BLOCK, EPOCH_KEY, INTENT_KEY, ControlPlaneStore, DirBackend,
                                      MemoryBackend, StoreError, open_store)
from llmgw.settings import parse_server_settings

from cp_state_fakes import Clock, FakeSession, register, settings


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_cordon_outlives_the_store_that_recorded_it(tmp_path):
    store = ControlPlaneStore(DirBackend(tmp_path / "state"))
    store.set_cordon("a", "cordoned")
    store.set_cordon("b", "draining")
    store.add_drain("tiny/sim#0")
    again = ControlPlaneStore(DirBackend(tmp_path / "state"))
    assert again.intent.cordons == {"a": "cordoned", "b": "draining"}
    assert again.intent.drains == {"tiny/sim#0"}
    again.set_cordon("a", None)
    assert ControlPlaneStore(DirBackend(tmp_path / "state")).intent.cordons == {"b": "draining"}


def test_files_are_0600_in_a_0700_directory_even_one_made_wider(tmp_path):
    d = tmp_path / "state"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    store = ControlPlaneStore(DirBackend(d))
    store.set_cordon("a", "cordoned")
    store.next_epoch()
    assert mode(d) == 0o700
    assert sorted(p.name for p in d.iterdir()) == [EPOCH_KEY, INTENT_KEY]  # no temporary file left behind
    assert {mode(p) for p in d.iterdir()} == {0o600}


def test_a_file_others_can_read_is_refused(tmp_path):
    store = ControlPlaneStore(DirBackend(tmp_path))
    store.set_cordon("a", "cordoned")
    os.chmod(tmp_path / INTENT_KEY, 0o644)
    with pytest.raises(StoreError, match="chmod 600"):
        ControlPlaneStore(DirBackend(tmp_path))


def test_epochs_rise_across_restarts_even_past_a_block_never_used(tmp_path):
    first = ControlPlaneStore(DirBackend(tmp_path))
    seen = [first.next_epoch() for _ in range(3)]
    assert seen == [1, 2, 3]
    second = ControlPlaneStore(DirBackend(tmp_path))  # the first died with most of its block unused
    e = second.next_epoch()
    assert e > max(seen)
    for _ in range(EPOCH_BLOCK + 1):  # through a block boundary
        e2 = second.next_epoch()
        assert e2 > e
        e = e2
    third = ControlPlaneStore(DirBackend(tmp_path))
    assert third.next_epoch() > e


def test_a_damaged_intent_file_stops_the_start_with_the_pointer(tmp_path):
    (tmp_path / INTENT_KEY).write_text(json.dumps({"version": 1, "cordons": {"a": "maybe"}}))
    os.chmod(tmp_path / INTENT_KEY, 0o600)
    with pytest.raises(StoreError, match="/cordons/a: 'maybe' is not one of cordoned, draining"):
        ControlPlaneStore(DirBackend(tmp_path))
    (tmp_path / INTENT_KEY).write_text("{half")
    with pytest.raises(StoreError, match="not JSON"):
        ControlPlaneStore(DirBackend(tmp_path))
    (tmp_path / EPOCH_KEY).write_text('{"reserved": -4}')
    os.chmod(tmp_path / EPOCH_KEY, 0o600)
    (tmp_path / INTENT_KEY).unlink()
    with pytest.raises(StoreError, match="/reserved"):
        ControlPlaneStore(DirBackend(tmp_path))


def test_a_write_that_fails_changes_nothing(tmp_path):
    store = ControlPlaneStore(DirBackend(tmp_path))
    (tmp_path / INTENT_KEY).mkdir()  # the rename onto it fails, as on a full or read-only disk
    with pytest.raises(StoreError, match=INTENT_KEY):
        store.set_cordon("b", "cordoned")
    assert store.intent.cordons == {}
    cp = ControlPlane(settings(replicas=0), clock=Clock(), store=store)
    cp.register(register("b"), FakeSession())
    with pytest.raises(StoreError):
        cp.cordon("b", "cordoned")
    assert cp.nodes["b"].cordon is None, "memory agrees with what was recorded"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_without_state_dir_intent_lives_in_memory_and_says_so(caplog):
    store = open_store(None)
    assert isinstance(store.backend, MemoryBackend) and not store.durable
    assert "un-cordons every node" in caplog.text


def test_state_dir_setting_is_optional_and_validated():
    doc = dict(settings().raw)
    assert parse_server_settings(doc).state_dir is None
    assert parse_server_settings({**doc, "state_dir": "/var/lib/llmgw/control-plane"}).state_dir == \
        "/var/lib/llmgw/control-plane"
    from llmgw.config import ConfigInvalid
    with pytest.raises(ConfigInvalid, match="/state_dir"):
        parse_server_settings({**doc, "state_dir": ""})


def test_a_restarted_control_plane_keeps_the_cordon_and_places_nothing_there(tmp_path):
    clock = Clock()
    cp = ControlPlane(settings(replicas=0), clock=clock, store=ControlPlaneStore(DirBackend(tmp_path)))
    first = cp.register(register("a"), FakeSession())
    cp.cordon("a", "cordoned")

    clock.t += 10  # a new process on the same state_dir
    cp2 = ControlPlane(settings(replicas=1), clock=clock, store=ControlPlaneStore(DirBackend(tmp_path)))
    s = FakeSession()
    epoch = cp2.register(register("a"), s)
    assert epoch > first, "an epoch is never handed out twice"
    assert cp2.nodes["a"].cordon == "cordoned"
    cp2.tick()
    assert not [m for m in s.sent if m["type"] == "start"], "nothing new lands on a cordoned node"
    assert "not schedulable" in str(cp2.unplaced)


def test_a_kept_cordon_can_be_lifted_before_its_node_is_back(tmp_path):
    store = ControlPlaneStore(DirBackend(tmp_path))
    store.set_cordon("a", "draining")
    cp = ControlPlane(settings(replicas=0), clock=Clock(), store=store)
    assert cp.cordon("a", None) == "draining"
    with pytest.raises(KeyError):
        cp.cordon("never-seen", "cordoned")
    assert ControlPlaneStore(DirBackend(tmp_path)).intent.cordons == {}


def test_ha_settings_are_validated_with_pointers():
    from llmgw.config import ConfigInvalid

    doc = dict(settings().raw)
    ok = parse_server_settings({**doc, "ha": {"etcd": {"endpoints": ["http://127.0.0.1:2379"]},
                                              "lease_ttl": 6, "renew_interval": 1}}).ha
    assert ok.endpoints == ("http://127.0.0.1:2379",) and ok.lease_ttl == 6 and ok.renew_interval == 1.0
    assert ok.prefix == "/llmgw"
    bad = {"etcd": {"endpoints": ["https://10.0.0.1:2379", "http://10.0.0.2:2379"], "cert": "c.crt"},
           "lease_ttl": 4, "renew_interval": 3}
    with pytest.raises(ConfigInvalid) as e:
        parse_server_settings({**doc, "ha": bad})
    text = str(e.value)
    for pointer in ("/ha/renew_interval", "/ha/etcd/ca", "/ha/etcd/endpoints/1", "/ha/etcd/key"):
        assert pointer in text, (pointer, text)
    with pytest.raises(ConfigInvalid, match="/ha/lease_ttl"):
        parse_server_settings({**doc, "ha": {"etcd": {"endpoints": ["http://127.0.0.1:1"]}, "lease_ttl": 1}})
