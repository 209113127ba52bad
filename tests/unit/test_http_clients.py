"""The package speaks HTTP through the stacks docs/architecture.md ("HTTP clients") names, and no other.

Each stack there has one job; a module reaching for another client
library (or for httpx or huggingface_hub outside their jobs) fails here by
name, so a sixth stack is a decision written in that table, not an accident.
"""

from __future__ import annotations

import ast
from pathlib import Path

import llmgw

PACKAGE = Path(llmgw.__file__).parent
NEVER = ("requests", "urllib.request", "http.client", "urllib3", "pycurl")
ONLY_IN = {
    "httpx": ("controlplane/etcd.py", "weightprobe.py", "ctl/"),
    "huggingface_hub": ("weightprobe.py", "agent/fetch/"),
}


def imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def test_http_clients_are_the_documented_ones():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for name in imports(path):
            top = name.split(".")[0]
            if name in NEVER or top in NEVER:
                found.append(f"{rel}: {name} (not one of the package's HTTP clients)")
            elif top in ONLY_IN and not rel.startswith(ONLY_IN[top]):
                found.append(f"{rel}: {name} (only in {', '.join(ONLY_IN[top])})")
    assert not found, "see docs/architecture.md, HTTP clients: " + "; ".join(found)


def test_the_architecture_names_every_stack():
    text = (PACKAGE.parents[1] / "docs" / "architecture.md").read_text()
    section = text.split("## HTTP clients", 1)[1].split("\n## ", 1)[0]
    for name in ("router/upstream.py", "aiohttp", "httpx", "huggingface_hub", "open_url", "test_http_clients.py"):
        assert name in section, name
