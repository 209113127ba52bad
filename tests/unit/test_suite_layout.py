"""The test tree's wiring: what a bare ``pytest`` from the repository root needs to collect.

Test files are imported by basename (pytest puts each directory on the path),
so two ``test_x.py`` in two directories collide and stop collection for the
whole run; a helper named like a test is collected as one; a test that
imports another test module's helpers runs that module's import side effects
and breaks when the other test moves.  Shared code lives in helper modules
(not named ``test_*``) or in ``tests.support``, the bottom layer that the
suites and the benchmarks import and that imports neither.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
BENCHMARKS = ROOT / "benchmarks"
PACKAGE_FILES = {"__init__.py", "conftest.py"}  # pytest imports these by package or special-cases them


def modules(*roots: Path) -> list[Path]:
    return sorted(p for r in roots for p in r.rglob("*.py") if ".venv" not in p.parts and "__pycache__" not in p.parts)


def imported(path: Path) -> set[str]:
    """Every module name ``path`` imports, at any depth (a function-local import counts too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


def test_every_module_under_tests_has_a_basename_of_its_own():
    by_name = defaultdict(list)
    for p in modules(TESTS):
        if p.name not in PACKAGE_FILES and TESTS / "support" not in p.parents:
            by_name[p.name].append(str(p.relative_to(ROOT)))
    assert {n: ps for n, ps in by_name.items() if len(ps) > 1} == {}


def test_every_test_file_holds_tests_and_no_helper_is_named_like_one():
    empty = []
    for p in modules(TESTS):
        if p.name.startswith("test_"):
            tree = ast.parse(p.read_text(), str(p))
            if not any((isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test_"))
                       or (isinstance(n, ast.ClassDef) and n.name.startswith("Test")) for n in tree.body):
                empty.append(str(p.relative_to(ROOT)))
    assert empty == []


def test_no_module_imports_a_test_module():
    tests = {p.stem for p in modules(TESTS) if p.name.startswith("test_")}
    offenders = {str(p.relative_to(ROOT)): sorted(m for m in imported(p) if m.split(".")[-1] in tests)
                 for p in modules(TESTS, BENCHMARKS)}
    assert {p: ms for p, ms in offenders.items() if ms} == {}


def test_support_is_the_bottom_layer():
    """tests.support imports only llmgw, libraries and itself: never a suite's helper or a benchmark."""
    local = {p.stem for p in modules(TESTS, BENCHMARKS) if TESTS / "support" not in p.parents}
    wrong = {}
    for p in modules(TESTS / "support"):
        bad = sorted(m for m in imported(p) if m.split(".")[0] in local | {"benchmarks"}
                     or (m.startswith("tests.") and not m.startswith("tests.support")))
        if bad:
            wrong[str(p.relative_to(ROOT))] = bad
    assert wrong == {}


def test_no_module_imports_a_private_name_of_a_tests_or_benchmarks_module():
    local = {p.stem for p in modules(TESTS, BENCHMARKS)}
    wrong = {}
    for p in modules(TESTS, BENCHMARKS):
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if (isinstance(node, ast.ImportFrom) and node.module and not node.level
                    and (node.module.split(".")[-1] in local or node.module.split(".")[0] == "tests")):
                private = [a.name for a in node.names if a.name.startswith("_")]
                if private:
                    wrong.setdefault(str(p.relative_to(ROOT)), []).extend(private)
    assert wrong == {}
