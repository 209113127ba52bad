"""The wire vocabulary has one room (llmgw.protocol), and the layers above it point down only."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import llmgw
from llmgw import protocol
from llmgw.controlplane import replicas
from tests.support.statewords import literal_state_comparisons

PACKAGE = Path(llmgw.__file__).parent
WIRE_NAMES = {"STREAM_PATH", "WATCH_PATH", "EJECTIONS_PATH", "LEADER_EPOCH_HEADER", "MAX_MESSAGE", "ShardState",
              "NodeState", "ReplicaState", "Cordon", "SCHEDULABLE"}
# Modules being split along their seams right now: their few literals are named once the split lands.
STATE_LITERALS_PENDING: tuple[str, ...] = ()


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).with_suffix("").as_posix().replace("/", "."), ast.parse(path.read_text())


def imported(tree: ast.Module) -> set[str]:
    """Every llmgw module a module imports, at top level or inside a function."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return {n for n in names if n == "llmgw" or n.startswith("llmgw.")}


def test_wire_names_are_defined_only_in_protocol():
    defined = {}
    for name, tree in modules():
        for node in tree.body:
            targets = [node.name] if isinstance(node, ast.ClassDef) else \
                [t.id for t in getattr(node, "targets", ()) if isinstance(t, ast.Name)]
            for t in targets:
                if t in WIRE_NAMES:
                    defined.setdefault(t, []).append(name)
    assert defined == {n: ["protocol"] for n in WIRE_NAMES}


def test_protocol_imports_nothing_of_the_package():
    tree = ast.parse((PACKAGE / "protocol.py").read_text())
    assert imported(tree) == set()


def test_settings_and_control_plane_import_nothing_from_the_agent():
    upward = {name: sorted(m for m in imported(tree) if m.startswith("llmgw.agent"))
              for name, tree in modules() if name == "settings" or name.startswith("controlplane.")}
    assert {k: v for k, v in upward.items() if v} == {}


def test_shard_states_are_the_stream_schemas():
    schema = json.loads((PACKAGE / "schemas" / "stream.schema.json").read_text())
    found = []

    def walk(node):
        if isinstance(node, dict):
            state = node.get("state")
            if isinstance(state, dict) and "enum" in state:
                found.append(state["enum"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(schema)
    assert found and all(e == [s.value for s in protocol.ShardState] for e in found)
    # the control plane's shards hold the same words, as plain strings
    assert (replicas.PENDING, replicas.READY, replicas.STOPPED) == ("pending", "ready", "stopped")
    assert all(type(s) is str for s in replicas.RUNNING_STATES | replicas.ENDED_STATES)


def test_the_package_compares_states_by_name():
    """A node, replica, cordon or shard state is compared by its protocol name, never a literal of its own."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "protocol.py" or rel.startswith(STATE_LITERALS_PENDING):
            continue
        found += [f"{rel}:{where}" for _, where in literal_state_comparisons(path)]
    assert not found, "compare with llmgw.protocol's names: " + "; ".join(found)


def test_the_control_plane_reports_the_protocols_states():
    from llmgw.controlplane import lifecycle, listquery, openapi, store

    assert lifecycle.NodeState is protocol.NodeState and replicas.ReplicaState is protocol.ReplicaState
    assert listquery.NODE_STATES == tuple(s.value for s in protocol.NodeState)
    assert store.CORDON_STATES == tuple(c.value for c in protocol.Cordon)
    assert openapi.CORDON == {"enum": [None, *store.CORDON_STATES]}
