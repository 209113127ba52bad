"""The wire vocabulary has one room (llmgw.protocol), and the layers above it point down only."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import llmgw
from llmgw import protocol
from llmgw.controlplane import replicas

PACKAGE = Path(llmgw.__file__).parent
WIRE_NAMES = {"STREAM_PATH", "WATCH_PATH", "EJECTIONS_PATH", "LEADER_EPOCH_HEADER", "MAX_MESSAGE", "ShardState"}


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
