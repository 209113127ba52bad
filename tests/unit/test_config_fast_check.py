"""The compiled validator may only ever say "valid" where jsonschema does.

It is a fast path in front of ``schema_errors`` for every stream message; if
it accepted something the schema refuses, a malformed message would reach
the control plane's book.  So every stream definition is checked with
documents mutated at random, and the two must agree whenever the fast one
accepts.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.config import fast_check, load_schema, schema_errors

HW = yaml.safe_load((Path(__file__).parents[1] / "fixtures/hardware/ib-a-node1.yaml").read_text())

SPEC = {"shard_id": "m.p.0-abc/r0", "replica_id": "m.p.0-abc",
        "model": {"name": "m", "source": "org/m", "served_name": "m", "size_bytes": None, "sha256": None},
        "profile": {"name": "p", "engine": "vllm", "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                    "nodes": 1, "extra_args": [], "env": {}, "start_timeout": 600},
        "rank": 0, "nnodes": 1, "gpu_indices": [0], "env": {}, "master_addr": None, "master_port": None}

VALID: dict[str, dict[str, Any]] = {
    "register": {"type": "register", "node_id": HW["node_id"], "agent_version": "0.1", "boot_id": "b",
                 "address": "10.0.0.1", "hardware": HW,
                 "shards": [{"spec": SPEC, "state": "ready", "port": 20001,
                             "process": {"pid": 10, "start_time": 5, "boot_id": "b"}}]},
    "heartbeat": {"type": "heartbeat", "seq": 3, "time": 1700000000.5},
    "shard_status": {"type": "shard_status", "shard_id": "m.p.0-abc/r0", "state": "failed",
                     "reason": "exit 1", "output_tail": "boom"},
    "progress": {"type": "progress", "source": "https://h/w.gguf", "bytes_done": 5, "bytes_total": 10},
    "start": {"type": "start", "spec": SPEC},
    "stop": {"type": "stop", "shard_id": "m.p.0-abc/r0", "reason": "retired"},
}

JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False)
                    | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=6)


def _paths(doc: Any, here: tuple = ()) -> list[tuple]:
    out = [here]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, here + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, here + (i,))
    return out


@st.composite
def mutated(draw: st.DrawFn, kind: str) -> dict[str, Any]:
    doc = copy.deepcopy(VALID[kind])
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(doc) if p]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = doc
        for step in path[:-1]:
            parent = parent[step]
        how = draw(st.sampled_from(["replace", "delete", "add"]))
        if how == "replace":
            parent[path[-1]] = draw(JSON)
        elif how == "delete" and isinstance(parent, dict):
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.text(max_size=6))] = draw(JSON)
    return doc


def test_every_stream_definition_is_covered():
    assert set(VALID) <= set(load_schema("stream")["$defs"])


@pytest.mark.parametrize("kind", sorted(VALID))
def test_valid_messages_pass_both(kind):
    assert schema_errors(VALID[kind], "stream", kind) == []
    assert fast_check("stream", kind)(VALID[kind])


@pytest.mark.parametrize("kind", sorted(VALID))
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_fast_check_never_accepts_what_the_schema_refuses(kind, data):
    doc = data.draw(mutated(kind))
    if fast_check("stream", kind)(doc):
        assert schema_errors(doc, "stream", kind) == [], doc


def test_a_hardware_document_is_checked_through_the_stream_schema():
    bad = copy.deepcopy(VALID["register"])
    bad["hardware"]["gpus"][0]["memory_bytes"] = "80GB"
    assert not fast_check("stream", "register")(bad)
    assert any("/hardware/gpus/0/memory_bytes" in str(e) for e in schema_errors(bad, "stream", "register"))


def test_unknown_definition_is_a_key_error():
    with pytest.raises(KeyError):
        fast_check("stream", "nope")
