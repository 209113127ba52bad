"""How the command line treats its subsystems, as cli.py's docstring states it: one not in
the build is left out; one that fails to import for any other reason stops the command."""

from __future__ import annotations

import argparse
import sys

import pytest

from llmgw import cli


def subparsers() -> argparse._SubParsersAction:
    return argparse.ArgumentParser(prog="t").add_subparsers()


def test_a_subsystem_not_in_the_build_is_left_out():
    sub = subparsers()
    cli._register(sub, [("llmgw.no_such_subsystem", "nothing"), ("llmgw.config_cli", "config")])
    assert list(sub.choices) == ["config"]


def test_a_subsystem_whose_dependency_is_missing_stops_the_command(tmp_path, monkeypatch):
    (tmp_path / "llmgw_broken_subsystem.py").write_text("import llmgw_dependency_nobody_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="llmgw_dependency_nobody_installed"):
        cli._register(subparsers(), [("llmgw_broken_subsystem", "broken")])
    sys.modules.pop("llmgw_broken_subsystem", None)


def test_ctl_help_names_every_registered_subcommand(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["ctl", "--help"])
    out = capsys.readouterr().out
    for name in ("explain", "cert", "nodes", "replicas", "drain", "cordon", "uncordon", "openapi", "manifest"):
        assert name in out
