"""The readiness filters site.yml's last play builds its failure message from
(plugins/filter/fleet.py: short_deployments, describe_replica, describe_unplaced),
on answers shaped like the control plane's ``GET /v1/replicas``.

The plugin file is imported by path, as Ansible loads it: it must work with
nothing but Ansible installed, so no plugin of the collection may import the
llmgw runtime (nodes have it, the controller need not).
"""

from __future__ import annotations

import ast

import pytest
from ansible.errors import AnsibleFilterError

from fleet_harness import PLUGINS, load_plugin


fleet = load_plugin(PLUGINS / "filter" / "fleet.py")

DEPLOYMENTS = [
    {"model": "small", "profile": "tp1", "replicas": 2},
    {"model": "big", "profile": "tp2", "replicas": 1},
    {"model": "none", "profile": "tp1", "replicas": 0},
]


def _shard(shard_id, state, node="gpu0", reason=None, progress=None):
    return {"shard_id": shard_id, "rank": 0, "node_id": node, "state": state, "reason": reason, "progress": progress}


def _replica(replica_id, model, profile, state, reason=None, last_failure=None, shards=()):
    return {"replica_id": replica_id, "model": model, "profile": profile, "state": state, "reason": reason,
            "last_failure": last_failure, "shards": list(shards)}


def test_every_filter_is_registered_under_its_documented_name():
    names = fleet.FilterModule().filters()
    assert set(names) == {"short_deployments", "describe_replica", "describe_unplaced"}
    for name in names:
        assert (PLUGINS / "filter" / f"{name}.yml").is_file(), name


def test_short_deployments_counts_only_ready_replicas_of_the_same_model_and_profile():
    replicas = [
        _replica("r1", "small", "tp1", "ready"),
        _replica("r2", "small", "tp1", "starting"),
        _replica("r3", "small", "tp2", "ready"),  # another profile: not this deployment's
        _replica("r4", "big", "tp2", "failed"),
    ]
    assert fleet.short_deployments(DEPLOYMENTS, replicas) == ["small/tp1: 1 of 2 Ready", "big/tp2: 0 of 1 Ready"]


def test_short_deployments_is_empty_when_every_deployment_is_served():
    replicas = [_replica("r1", "small", "tp1", "ready"), _replica("r2", "small", "tp1", "ready"),
                _replica("r3", "big", "tp2", "ready")]
    assert fleet.short_deployments(DEPLOYMENTS, replicas) == []
    assert fleet.short_deployments(DEPLOYMENTS, replicas + [_replica("r4", "small", "tp1", "ready")]) == []


def test_short_deployments_with_no_answer_yet_lists_every_declared_replica():
    assert fleet.short_deployments(DEPLOYMENTS, []) == ["small/tp1: 0 of 2 Ready", "big/tp2: 0 of 1 Ready"]


@pytest.mark.parametrize("args", [(None, []), (DEPLOYMENTS, None), ({"model": "x"}, [])])
def test_short_deployments_refuses_what_is_not_a_list(args):
    with pytest.raises(AnsibleFilterError, match="short_deployments"):
        fleet.short_deployments(*args)


def test_a_failed_shard_gives_its_reason():
    replica = _replica("small-tp1-0-abc", "small", "tp1", "starting", shards=[
        _shard("small-tp1-0-abc-r0", "failed", reason="sha256 mismatch: expected aaa, got bbb; nothing was promoted"),
    ])
    assert fleet.describe_replica(replica) == (
        "small-tp1-0-abc (small/tp1) starting: shard small-tp1-0-abc-r0 on gpu0 failed: "
        "sha256 mismatch: expected aaa, got bbb; nothing was promoted")


def test_a_fetching_shard_gives_its_download_progress_and_note():
    replica = _replica("big-tp2-0-abc", "big", "tp2", "starting", shards=[
        _shard("big-tp2-0-abc-r0", "fetching", progress={
            "file": "model.gguf", "bytes_done": 3 * 2**30, "bytes_total": 4 * 2**30,
            "note": "stalled: no bytes for 60s; retry 1 of 5 in 2s"}),
        _shard("big-tp2-0-abc-r1", "waiting", node="gpu1"),
    ])
    assert fleet.describe_replica(replica) == (
        "big-tp2-0-abc (big/tp2) starting: shard big-tp2-0-abc-r0 on gpu0 fetching: downloading model.gguf "
        "3.0 GiB of 4.0 GiB (stalled: no bytes for 60s; retry 1 of 5 in 2s); shard big-tp2-0-abc-r1 on gpu1 waiting")


def test_a_download_of_unknown_length_says_so_far():
    shard = _shard("s", "fetching", progress={"source": "https://x/m.gguf", "bytes_done": 512, "bytes_total": None})
    assert fleet.describe_shard(shard) == "shard s on gpu0 fetching: downloading https://x/m.gguf 512 B so far"


def test_a_reason_is_given_once_and_ready_shards_are_left_out():
    """A replica that failed because a shard did quotes the shard's reason, and its slot's last
    failure is that same failure: the sentence says it once."""
    replica = _replica(
        "small-tp1-1-def", "small", "tp1", "failed", reason="shard r0 on gpu0 failed: engine exited 1",
        last_failure={"replica_id": "small-tp1-1-def", "reason": "shard r0 on gpu0 failed: engine exited 1",
                      "output_tail": "Traceback ...", "ago_s": 3.5},
        shards=[_shard("small-tp1-1-def-r0", "failed", reason="engine exited 1"),
                _shard("small-tp1-1-def-r1", "ready", node="gpu1")])
    assert fleet.describe_replica(replica) == "small-tp1-1-def (small/tp1) failed: shard r0 on gpu0 failed: engine exited 1"


def test_a_replacement_says_why_the_replica_before_it_failed():
    replica = _replica(
        "small-tp1-1-new", "small", "tp1", "starting",
        last_failure={"replica_id": "small-tp1-1-old", "reason": "shard r0 on gpu0 failed: engine exited 1",
                      "output_tail": "Traceback (most recent call last) ...", "ago_s": 3.5},
        shards=[_shard("small-tp1-1-new-r0", "starting"), _shard("small-tp1-1-new-r1", "ready", node="gpu1")])
    text = fleet.describe_replica(replica)
    assert text == ("small-tp1-1-new (small/tp1) starting: last failure (replica small-tp1-1-old, 3.5s ago): "
                    "shard r0 on gpu0 failed: engine exited 1; shard small-tp1-1-new-r0 on gpu0 starting")
    assert "Traceback" not in text  # the engine's output tail stays in `llmgw ctl replicas`
    assert "gpu1" not in text  # a Ready shard is not why the replica is not Ready


def test_a_replica_with_nothing_to_say_is_just_its_state():
    assert fleet.describe_replica(_replica("r", "m", "p", "starting", shards=[_shard("r-r0", "starting")])) == (
        "r (m/p) starting: shard r-r0 on gpu0 starting")
    assert fleet.describe_replica(_replica("r", "m", "p", "pending")) == "r (m/p) pending"


def test_an_unplaced_slot_says_why_and_a_backoff_says_what_failed():
    assert fleet.describe_unplaced({"model": "big", "profile": "tp2", "slot": 1,
                                    "reason": "no node has 2 free GPUs", "last_failure": None}) == (
        "big/tp2 #1: no node has 2 free GPUs")
    assert fleet.describe_unplaced({
        "model": "big", "profile": "tp2", "slot": 0, "reason": "restarting in 8s (failure 2, exponential backoff)",
        "last_failure": {"replica_id": "big-tp2-0-abc", "reason": "shard r0 on gpu0 failed: model path /m does not exist",
                         "output_tail": None}}) == (
        "big/tp2 #0: restarting in 8s (failure 2, exponential backoff); "
        "last failure: shard r0 on gpu0 failed: model path /m does not exist")


@pytest.mark.parametrize("name", ["describe_replica", "describe_unplaced"])
def test_describe_refuses_what_is_not_an_object(name):
    with pytest.raises(AnsibleFilterError, match=name):
        getattr(fleet, name)("not an object")


def test_no_plugin_imports_the_llmgw_runtime():
    offenders = []
    for path in sorted(PLUGINS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            offenders += [f"{path.relative_to(PLUGINS)}: {n}" for n in names if n == "llmgw" or n.startswith("llmgw.")]
    assert offenders == []
