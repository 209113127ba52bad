"""``llmgw_deployments`` with ``autoscale`` through ansible-playbook, from the inventory to server.yaml.

The block goes to the catalog as declared (``sleep`` and ``priority`` inside it). Bad input
never reaches a host's file: what the runtime's JSON Schema refuses fails the preflight on
the controller with the JSON pointer and the variable; what only the runtime's semantic
checks see (``min`` above ``max``) fails the control_plane role's template at its
``validate:``, in the runtime's own words with the pointer, and nothing is written.
"""

from __future__ import annotations

import grp
import os
import sys

import pytest
import yaml

from fleet_harness import PLAYBOOKS, REPO, run_playbook

PLAY = PLAYBOOKS / "deployments.yml"
AUTOSCALE = {"min": 1, "max": 4, "target": 8, "priority": 10, "sleep": {"after": 300, "level": 1}}
# One control plane per case, each with its own declaration and prefix, in one run.
CASES = {
    "cp-ok": AUTOSCALE,
    "cp-schema": {"max": 0, "sleep": {"after": 300, "level": 3}},  # the JSON Schema refuses it
    "cp-bounds": {"min": 3, "max": 2, "panic_window": 120},  # only the runtime's semantic checks do
}


def deployment(autoscale):
    return {"model": "qwen", "profile": "vllm-tp1", "replicas": 2, "autoscale": autoscale}


@pytest.fixture(scope="module")
def play(tmp_path_factory):
    """The play on the three control planes, each writing under its own prefix, validated by this checkout's runtime."""
    root = tmp_path_factory.mktemp("deployments")
    venv = root / "venv"
    (venv / "bin").mkdir(parents=True)
    llmgw = venv / "bin" / "llmgw"
    llmgw.write_text(f"#!/bin/sh\nPYTHONPATH={REPO / 'agent'} exec {sys.executable} -m llmgw \"$@\"\n")
    llmgw.chmod(0o755)
    hosts = {}
    for host, autoscale in CASES.items():
        (root / host / "etc" / "llmgw").mkdir(parents=True)
        hosts[host] = {"llmgw_prefix": str(root / host), "llmgw_deployments": [deployment(autoscale)]}
    fleet = {"all": {
        "vars": {
            "ansible_connection": "local",
            "ansible_python_interpreter": sys.executable,
            "llmgw_control_plane_address": "cp.fleet.test",
            "llmgw_ha": False,
            "llmgw_venv_dir": str(venv),
            "llmgw_service_group": grp.getgrgid(os.getegid()).gr_name,
            "llmgw_models": [{"name": "qwen", "source": "Qwen/Qwen2.5-0.5B-Instruct", "size_bytes": 988097824}],
            "llmgw_profiles": [{"name": "vllm-tp1", "engine": "vllm"}],
            # the in-process router: its requests in flight are the autoscaler's signal
            "llmgw_router": {"listen": {"host": "127.0.0.1", "port": 18080}, "allow_unauthenticated": True},
        },
        "children": {"llmgw_control_plane": {"hosts": hosts}, "llmgw_agents": {"hosts": {"gpu-a1": None}}},
    }}
    inventory = root / "inventory.yml"
    inventory.write_text(yaml.safe_dump(fleet))
    return root, run_playbook(PLAY, root / "runs", inventory=inventory, limit="llmgw_control_plane")


def rendered(root, host):
    return root / host / "etc" / "llmgw" / "server.yaml"


def test_autoscale_reaches_server_yaml_as_declared(play):
    root, res = play
    (render,) = res.task("Render server.yaml", "cp-ok")
    assert render.status == "ok" and render.changed, res.explain()
    doc = yaml.safe_load(rendered(root, "cp-ok").read_text())
    assert doc["deployments"] == [deployment(AUTOSCALE)]


def test_a_block_the_schema_refuses_fails_on_the_controller_with_pointer_and_variable(play):
    root, res = play
    (failed,) = res.task("Refuse an invalid declared fleet", "cp-schema")
    assert failed.status == "failed", res.explain()
    msg = failed.res["msg"]
    assert "/deployments/0/autoscale/max (llmgw_deployments[0].autoscale.max): 0 is less than the minimum of 1" in msg
    assert "/deployments/0/autoscale/sleep/level (llmgw_deployments[0].autoscale.sleep.level): 3 is not one of" in msg
    assert res.task("Render server.yaml", "cp-schema") == []
    assert not rendered(root, "cp-schema").exists()


def test_bounds_only_the_runtime_checks_fail_at_the_template_naming_the_pointer(play):
    root, res = play
    assert res.rc != 0
    assert [r.status for r in res.task("Refuse an invalid declared fleet", "cp-bounds")] == ["ok"], res.explain()
    (render,) = res.task("Render server.yaml", "cp-bounds")
    assert render.status == "failed" and render.res["msg"] == "failed to validate", render.res
    assert "/deployments/0/autoscale/min: 3 is more than max (2)" in render.res["stderr"], render.res
    assert "/deployments/0/autoscale/panic_window: 120s is longer than stable_window (60s)" in render.res["stderr"]
    assert not rendered(root, "cp-bounds").exists()
