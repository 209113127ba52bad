"""Finding a state compared by a literal (``x == "ready"``) where a name from llmgw.protocol belongs.

Used by the tests that keep the package and the collection's plugins on one
vocabulary: a literal that matches today's word silently stops matching
when the word changes, a name fails at import.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from llmgw.protocol import SCHEDULABLE, Cordon, NodeState, ReplicaState, ShardState

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
