"""Every runtime dependency's floor is pinned in constraints/floor.txt, which the oldest Python's tests install.

A range whose lower bound nothing installs is a claim nobody checks: pyproject
allowed any aiohttp from 3.9 while the proxy needed 3.12.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

packaging = pytest.importorskip("packaging.requirements")
from packaging.requirements import Requirement  # noqa: E402
from packaging.utils import canonicalize_name  # noqa: E402

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the oldest Python
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]


RUNTIME_EXTRAS = ("router-tokenize",)  # installed on runtime hosts (a router's model tokenizer): floored too


def runtime() -> list[Requirement]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    deps = list(project["dependencies"])
    for extra in RUNTIME_EXTRAS:
        deps += project["optional-dependencies"][extra]
    return [Requirement(d) for d in deps]


def floors() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints" / "floor.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version.strip()
    return pins


def test_each_runtime_dependency_has_a_floor_pin_at_its_lower_bound_and_an_upper_bound():
    pins = floors()
    problems = []
    for req in runtime():
        name = canonicalize_name(req.name)
        lower = [s.version for s in req.specifier if s.operator == ">="]
        if not lower or not any(s.operator in ("<", "<=", "~=", "==") for s in req.specifier):
            problems.append(f"{req}: needs a tested floor (>=) and a ceiling (<)")
            continue
        pin = pins.get(name)
        if pin is None:
            problems.append(f"{req}: no pin in constraints/floor.txt")
        elif not req.specifier.contains(pin, prereleases=True) or \
                pin.split(".")[:len(lower[0].split("."))] != lower[0].split("."):
            problems.append(f"{req}: floor.txt pins {pin}, not the lower bound {lower[0]}")
    assert problems == []
    assert set(pins) == {canonicalize_name(r.name) for r in runtime()}, "floor.txt pins a package the runtime does not need"
