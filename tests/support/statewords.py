"""One vocabulary of states for the package and the collection's plugins, checked.

Used by the tests that hold the collection's copies (``module_utils``) to
``llmgw.protocol`` and find a state compared by a literal (``x == "ready"``)
where a name belongs: a literal that matches today's word silently stops
matching when the word changes, a name fails at import.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterator
from types import ModuleType
from pathlib import Path

from llmgw.protocol import SCHEDULABLE, Cordon, NodeState, ReplicaState, ShardState

PLUGINS = Path(__file__).resolve().parents[2] / "collections" / "ansible_collections" / "llmgw" / "fleet" / "plugins"

# Every state word the control plane's API and the agent stream carry.
API_WORDS = frozenset({s.value for s in (*NodeState, *ReplicaState, *Cordon, *ShardState)} | {SCHEDULABLE})


def literal_state_comparisons(path: Path, words: frozenset[str] = API_WORDS) -> Iterator[tuple[str, str]]:
    """(word, "LINE: expression") for each ``== word``, ``!= word`` or ``in (word, ...)`` in ``path``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        for i, op in enumerate(node.ops):
            left, right = sides[i], sides[i + 1]
            if isinstance(op, (ast.Eq, ast.NotEq)):
                consts = [s for s in (left, right) if isinstance(s, ast.Constant)]
            elif isinstance(op, (ast.In, ast.NotIn)) and isinstance(right, (ast.Tuple, ast.List, ast.Set)):
                consts = [e for e in right.elts if isinstance(e, ast.Constant)]
            else:
                continue
            for c in consts:
                if c.value in words:
                    yield c.value, f"{node.lineno}: {ast.unparse(node)}"


def load_module_utils(name: str) -> ModuleType:
    """``plugins/module_utils/<name>.py`` loaded on its own, as a controller without llmgw would."""
    spec = importlib.util.spec_from_file_location(f"collection_{name}", PLUGINS / "module_utils" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def imported_modules(path: Path) -> list[str | None]:
    """What ``path`` imports (``from X import``: X; ``import X``: None), for the copies' import-nothing rule."""
    tree = ast.parse(path.read_text())
    return [getattr(n, "module", None) for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
