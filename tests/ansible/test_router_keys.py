"""The router role's API keys through ansible-playbook: plaintext keys in, digests only on the host.

Neither check mode, --diff, the play's output nor any file written holds a key;
the keys file is what the router reads (router.yaml's api_keys_file), so the
runtime's own parser reads it back here; a bad entry fails with the variable
and the JSON pointer to fix before anything is written.
"""

from __future__ import annotations

import grp
import os
import stat
import sys

import yaml

from fleet_harness import PLAYBOOKS, REPO, run_playbook

from llmgw.router.auth import hash_key
from llmgw.router.keysfile import read_keys

PLAY = PLAYBOOKS / "router_keys.yml"
KEYS = [
    {"name": "team-a", "key": "sk-llmgw-vaulted-team-a-0123456789abcdef", "models": ["m"],
     "limits": {"requests_per_minute": 600}},
    {"name": "team-b", "key": "sk-llmgw-vaulted-team-b-0123456789abcdef"},
]


def setup(tmp_path, keys):
    """Extra vars for a prefix under tmp_path, whose runtime is this checkout's (for the file's validation)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    llmgw = venv / "bin" / "llmgw"
    llmgw.write_text(f"#!/bin/sh\nPYTHONPATH={REPO / 'agent'} exec {sys.executable} -m llmgw \"$@\"\n")
    llmgw.chmod(0o755)
    (tmp_path / "etc" / "llmgw").mkdir(parents=True)
    return {"llmgw_prefix": str(tmp_path), "llmgw_venv_dir": str(venv), "llmgw_router_api_keys": keys,
            "llmgw_service_group": grp.getgrgid(os.getegid()).gr_name, "llmgw_service_manager": "process",
            "_router_just_started": True}  # no router process here to reload


def leaked(run, tmp_path, keys) -> list[str]:
    """Where a plaintext key shows: the play's output, or any file written under the prefix."""
    where = []
    for k in keys:
        if k["key"] in run.stdout or any(k["key"] in repr(r.res) for r in run.results):
            where.append(f"output: {k['name']}")
        for path in (tmp_path / "etc").rglob("*"):
            if path.is_file() and k["key"] in path.read_text(errors="replace"):
                where.append(f"{path}: {k['name']}")
    return where


def test_keys_reach_the_host_as_digests_only_and_check_mode_and_diff_show_no_key(tmp_path):
    extravars = setup(tmp_path, KEYS)
    keys_file = tmp_path / "etc" / "llmgw" / "router-keys.yaml"

    check = run_playbook(PLAY, tmp_path / "runs", extravars=extravars, check=True, diff=True)
    assert check.rc == 0, check.explain()
    assert not keys_file.exists() and leaked(check, tmp_path, KEYS) == []

    apply = run_playbook(PLAY, tmp_path / "runs", extravars=extravars, diff=True)
    assert apply.rc == 0, apply.explain()
    assert leaked(apply, tmp_path, KEYS) == []
    assert [r.status for r in apply.task("Render the API keys file")] == ["ok"]
    assert stat.S_IMODE(keys_file.stat().st_mode) == 0o640
    entries = read_keys(keys_file)  # as the router reads it
    assert entries == [
        {"name": "team-a", "models": ["m"], "limits": {"requests_per_minute": 600}, "sha256": hash_key(KEYS[0]["key"])},
        {"name": "team-b", "sha256": hash_key(KEYS[1]["key"])},
    ]
    assert yaml.safe_load(keys_file.read_text())["api_keys"] == entries


def test_bad_entries_fail_together_with_the_variable_and_pointer_and_write_nothing(tmp_path):
    keys = [{"name": "team-a", "key": "sk-llmgw-vaulted-team-a-0123456789abcdef",
             "limits": {"requests_per_minute": 0}},
            {"name": "team-b", "key": "sk-guessable"}]
    run = run_playbook(PLAY, tmp_path / "runs", extravars=setup(tmp_path, keys))
    assert run.rc != 0
    [failed] = [r for r in run.results if r.status == "failed"]
    assert failed.task == "Refuse invalid API keys"
    msg = failed.res["msg"]
    assert "/api_keys/0/limits/requests_per_minute (llmgw_router_api_keys[0].limits.requests_per_minute)" in msg, msg
    assert "llmgw_router_api_keys[1].key (team-b): shorter than 24 characters" in msg, msg
    assert not (tmp_path / "etc" / "llmgw" / "router-keys.yaml").exists()
    assert leaked(run, tmp_path, keys) == []
