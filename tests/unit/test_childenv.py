"""The harnesses' children import the tree the harness was given, whatever their directory."""

from __future__ import annotations

import os

from tests.support.childenv import absolute_path_list, pin_pythonpath


def test_relative_entries_are_made_absolute_and_the_rest_kept(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    got = absolute_path_list(os.pathsep.join(["agent", "/opt/x", "", "tests/unit"]))
    assert got.split(os.pathsep) == [str(tmp_path / "agent"), "/opt/x", "", str(tmp_path / "tests" / "unit")]


def test_pinning_changes_only_a_pythonpath_that_is_set(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = {"PYTHONPATH": "agent"}
    pin_pythonpath(env)
    assert env == {"PYTHONPATH": str(tmp_path / "agent")}
    empty: dict[str, str] = {}
    pin_pythonpath(empty)
    assert empty == {}
