"""The runtime waits with ``compat.wait_for``, never ``asyncio.wait_for``.

Before 3.12 (CPython gh-86296) ``asyncio.wait_for`` loses a cancellation that
arrives in the loop iteration its awaitable completes in: a loop that waits on
an event with a timeout then never stops on SIGTERM (seen on 3.10 and 3.11 with
a control plane that kept registering agents for minutes). ``llmgw.compat``
explains the replacement; this keeps new code from reaching past it. The
simulator and the fleet simulator are test equipment, not shipped runtime paths
an operator stops with systemd, and are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

import llmgw

RUNTIME = Path(llmgw.__file__).parent
EXEMPT = ("sim",)  # the engine and fleet simulators


def _calls_asyncio_wait_for(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "wait_for" and \
                isinstance(node.value, ast.Name) and node.value.id == "asyncio":
            lines.append(node.lineno)
        if isinstance(node, ast.ImportFrom) and node.module == "asyncio" and \
                any(a.name == "wait_for" for a in node.names):
            lines.append(node.lineno)
    return lines


def test_no_runtime_module_calls_asyncio_wait_for():
    found = []
    for path in sorted(RUNTIME.rglob("*.py")):
        rel = path.relative_to(RUNTIME)
        if rel.parts[0] in EXEMPT or rel == Path("compat.py"):
            continue
        found += [f"{rel}:{n}" for n in _calls_asyncio_wait_for(ast.parse(path.read_text(), str(path)))]
    assert not found, "use llmgw.compat.wait_for (CPython gh-86296) at: " + ", ".join(found)


def test_the_fence_sees_both_spellings():
    assert _calls_asyncio_wait_for(ast.parse("import asyncio\nasync def f(e):\n    await asyncio.wait_for(e, 1)\n")) == [3]
    assert _calls_asyncio_wait_for(ast.parse("from asyncio import wait_for\n")) == [1]
    assert _calls_asyncio_wait_for(ast.parse("from llmgw import compat\ncompat.wait_for(x, 1)\n")) == []
