"""The harnesses' children import the tree the harness was given, whatever their directory."""

from __future__ import annotations

import os

from tests.support.childenv import absolute_path_list, child_env


def test_relative_entries_are_made_absolute_and_the_rest_kept(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    got = absolute_path_list(os.pathsep.join(["agent", "/opt/x", "", "tests/unit"]))
    assert got.split(os.pathsep) == [str(tmp_path / "agent"), "/opt/x", "", str(tmp_path / "tests" / "unit")]


def test_a_childs_environment_has_the_pythonpath_absolute_and_only_when_one_is_set(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", "agent")
    monkeypatch.setenv("KEPT", "1")
    env = child_env({"EXTRA": "2"})
    assert (env["PYTHONPATH"], env["KEPT"], env["EXTRA"]) == (str(tmp_path / "agent"), "1", "2")
    assert os.environ["PYTHONPATH"] == "agent"  # this process's own is left as it is
    assert child_env({"PYTHONPATH": "lib"})["PYTHONPATH"] == str(tmp_path / "lib")
    monkeypatch.delenv("PYTHONPATH")
    assert "PYTHONPATH" not in child_env()
