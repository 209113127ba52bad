"""The systemd units the roles install, as rendered for an inventory: the control
plane's and the agent's run as the service account, with the sandboxing each
can afford (the control plane needs only the network, its configuration and its
state; the agent's engines need the GPUs and RDMA devices, and must outlive it).

The pytest fleet runs plain processes (no systemd), and molecule checks the
agent's unit on a booted host; this reads both units the roles render, from
the roles' own templates and variables, through ansible-playbook.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from fleet_harness import PLAYBOOKS, REPO, run_playbook

ROLES = REPO / "collections" / "ansible_collections" / "llmgw" / "fleet" / "roles"
PREFIX = "/srv/fleet"
INVENTORY_VARS = {"llmgw_prefix": PREFIX, "llmgw_service_user": "svc-llmgw", "llmgw_service_group": "grp-llmgw"}
ETC, STATE, VENV = f"{PREFIX}/etc/llmgw", f"{PREFIX}/var/lib/llmgw", f"{PREFIX}/opt/llmgw/venv"

# What both units must set, exactly.
COMMON = {
    "User": ["svc-llmgw"],
    "Group": ["grp-llmgw"],
    "WorkingDirectory": [STATE],
    "NoNewPrivileges": ["yes"],
    "ProtectSystem": ["strict"],
    "ProtectHome": ["yes"],
    "PrivateTmp": ["yes"],
    "ProtectKernelTunables": ["yes"],
    "ProtectKernelModules": ["yes"],
    "ProtectKernelLogs": ["yes"],
    "ProtectControlGroups": ["yes"],
    "ProtectClock": ["yes"],
    "ProtectHostname": ["yes"],
    "RestrictNamespaces": ["yes"],
    "RestrictRealtime": ["yes"],
    "RestrictSUIDSGID": ["yes"],
    "LockPersonality": ["yes"],
    "SystemCallArchitectures": ["native"],
    "CapabilityBoundingSet": [""],  # no capabilities at all
    "AmbientCapabilities": [""],
    "ReadOnlyPaths": [ETC],
}


def _parse(text: str) -> dict[str, dict[str, list[str]]]:
    """A unit file as {section: {key: [values in order]}}; comments and blank lines left out."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, sep, value = line.partition("=")
        assert sep and current is not None, f"not a unit-file line: {line!r}"
        current.setdefault(key, []).append(value)
    return sections


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    run = run_playbook(PLAYBOOKS / "units.yml", tmp_path_factory.mktemp("units"), extravars=INVENTORY_VARS)
    assert run.rc == 0, run.explain()
    assert run.changed() == 0, run.explain()
    return {r.item["unit"]: r.res["msg"] for r in run.task("Render the units")}


@pytest.fixture(scope="module")
def units(rendered):
    return {name: _parse(text) for name, text in rendered.items()}


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_systemd_knows_every_directive(rendered, tmp_path):
    """A misspelt directive (ProtectSytem=) is ignored by systemd with a warning, and the
    sandboxing it stood for silently absent: systemd's own parser must accept every line."""
    for name, text in rendered.items():
        (tmp_path / name).write_text(text)
    out = subprocess.run(["systemd-analyze", "verify", *(str(tmp_path / n) for n in rendered)],
                         capture_output=True, text=True, timeout=60)
    # The commands do not exist on this machine; that is the only complaint allowed.
    problems = [line for line in (out.stdout + out.stderr).splitlines()
                if re.search(r"Unknown (key|section|lvalue)|Failed to parse|Invalid|[Ii]gnoring", line)]
    assert problems == [], out.stdout + out.stderr


@pytest.mark.parametrize("role, unit", [("control_plane", "llmgw-server.service"), ("agent", "llmgw-agent.service")])
def test_the_role_installs_this_template_as_the_unit(role, unit):
    tasks = yaml.safe_load((ROLES / role / "tasks" / "main.yml").read_text())
    (install,) = [t for t in tasks if t.get("name") == "Install the systemd unit"]
    assert install["ansible.builtin.template"]["src"] == f"{unit}.j2"
    assert install["ansible.builtin.template"]["dest"] == f"/etc/systemd/system/{unit}"


def test_the_control_plane_unit_is_hardened(units):
    service = units["llmgw-server.service"]["Service"]
    for key, value in COMMON.items():
        assert service.get(key) == value, (key, service.get(key))
    # The control plane needs no device, only IP and local sockets, writes only its state.
    assert service["PrivateDevices"] == ["yes"]
    assert service["RestrictAddressFamilies"] == ["AF_INET AF_INET6 AF_UNIX"]
    assert service["ReadWritePaths"] == [STATE]
    assert service["UMask"] == ["0077"]


def test_the_control_plane_unit_runs_the_server_and_reloads_it_with_sighup(units):
    unit = units["llmgw-server.service"]
    service = unit["Service"]
    assert service["ExecStart"] == [f"{VENV}/bin/llmgw server --config {ETC}/server.yaml"]
    assert service["ExecReload"] == ["/bin/kill -HUP $MAINPID"]  # a catalog change keeps the process (and the router)
    assert service["Type"] == ["simple"] and service["Restart"] == ["on-failure"]
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]
    assert unit["Unit"]["After"] == ["network-online.target"]


def test_the_agent_unit_is_hardened_but_keeps_devices_and_its_engines(units):
    unit = units["llmgw-agent.service"]
    service = unit["Service"]
    for key, value in COMMON.items():
        assert service.get(key) == value, (key, service.get(key))
    assert "PrivateDevices" not in service  # engines need the GPUs and RDMA devices
    assert service["KillMode"] == ["process"]  # a restart signals the agent alone; engines keep serving
    assert service["ReadWritePaths"] == [f"{STATE} {STATE}/models"]
    assert service["ExecStart"] == [f"{VENV}/bin/llmgw agent --config {ETC}/agent.yaml"]
    assert service["Restart"] == ["always"]
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]
