"""playbooks/site.yml against inventory/local, through ansible-playbook: the whole
all-in-one fleet (control plane + router, one agent with simulated GPUs, the
engine simulator) on this machine, in a private directory and on free ports.

check mode on a fresh machine writes nothing; the first run converges and its
last play proves every declared replica Ready and a chat completion answered
through the router; a second run and a second check change nothing. Then a new
build of the package reaches the node and playbooks/upgrade.yml replaces its
agent while clients keep sending completions: not one fails, and every engine
keeps running under the new agent. Last, a catalog change (one replica fewer)
reloads the running control plane (SIGHUP, same process), which applies it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import ssl
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from fleet_harness import REPO, run_playbook

SITE = REPO / "playbooks" / "site.yml"
UPGRADE = REPO / "playbooks" / "upgrade.yml"
INVENTORY = REPO / "inventory" / "local" / "hosts.yml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes_under(root: Path) -> list[int]:
    """Pids whose command line runs something installed under ``root`` (this test's fleet)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if str(root) in cmdline:
            pids.append(int(entry.name))
    return pids


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    root = tmp_path_factory.mktemp("site")
    api, router = free_port(), free_port()
    first = 40000 + (os.getpid() % 200) * 100
    # The runtime is built from a copy of the checkout's package sources taken now,
    # so every run of this module installs the same wheel even while the checkout
    # is being edited (an edited source is a new package, and rightly restarts).
    source = root / "source"
    shutil.copytree(REPO / "agent", source / "agent", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, source / name)
    extravars = {
        "llmgw_source_dir": str(source),
        "llmgw_prefix": str(root / "fleet") + "/{{ inventory_hostname }}",
        "llmgw_pki_ca_dir": str(root / "pki"),
        "llmgw_api_port": api,
        "llmgw_router": {"listen": {"host": "127.0.0.1", "port": router}, "allow_unauthenticated": True},
        "llmgw_engine_ports": {"first": first, "last": first + 99},
        "llmgw_verify_retries": 120,
    }
    runs = {}
    try:
        runs["check-fresh"] = run_playbook(SITE, root / "runs", inventory=INVENTORY, extravars=extravars, check=True, diff=True)
        runs["wrote-in-check"] = [p for p in (root / "fleet", root / "pki") if p.exists()]
        runs["apply"] = run_playbook(SITE, root / "runs", inventory=INVENTORY, extravars=extravars)
        runs["apply-again"] = run_playbook(SITE, root / "runs", inventory=INVENTORY, extravars=extravars)
        runs["check-again"] = run_playbook(SITE, root / "runs", inventory=INVENTORY, extravars=extravars, check=True, diff=True)
        if runs["apply"].rc == 0:
            runs["upgrade"] = upgrade_while_serving(root, router, extravars)
            runs["catalog"] = change_the_catalog(root, api, extravars)
        yield runs
    finally:
        # Engines outlive their agent by design: stop everything this fleet started.
        for pid in processes_under(root):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 30
        while processes_under(root) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in processes_under(root):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def engine_pids(root: Path) -> list[int]:
    pids = []
    for pid in processes_under(root):
        try:
            if "llmgw-engine-sim" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                pids.append(pid)
        except OSError:
            pass
    return sorted(pids)


def agent_pid(root: Path) -> int:
    record = root / "fleet" / "local-gpu0" / "var" / "lib" / "llmgw" / "run" / "llmgw-agent.pid"
    return json.loads(record.read_text())["pid"]


class Clients(threading.Thread):
    """Sends chat completions through the router, one after another, until stopped."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.url = f"http://127.0.0.1:{port}/v1/chat/completions"
        self.stopping = threading.Event()
        self.answered = 0
        self.failures: list[str] = []

    def run(self) -> None:
        body = json.dumps({"model": "qwen2.5-0.5b-instruct", "max_tokens": 4,
                           "messages": [{"role": "user", "content": "Say hello."}]}).encode()
        while not self.stopping.is_set():
            request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    if json.load(response).get("choices"):
                        self.answered += 1
                    else:
                        self.failures.append("an answer without choices")
            except Exception as exc:  # every failure counts, whatever its kind
                self.failures.append(repr(exc))
            time.sleep(0.05)


def upgrade_while_serving(root: Path, router: int, extravars: dict) -> dict:
    """A new build reaches the node (its copy of the wheel is not the controller's
    any more); upgrade.yml reinstalls and restarts the agent while clients send."""
    engines, agent, server = engine_pids(root), agent_pid(root), server_pid(root)
    for wheel in (root / "fleet" / "local-gpu0" / "opt" / "llmgw" / "wheels").glob("*.whl"):
        wheel.write_bytes(b"an older build")
    clients = Clients(router)
    clients.start()
    try:
        run = run_playbook(UPGRADE, root / "runs", inventory=INVENTORY, extravars=extravars)
    finally:
        time.sleep(1)
        clients.stopping.set()
        clients.join(60)
    return {"run": run, "engines_before": engines, "engines_after": engine_pids(root),
            "agent_before": agent, "agent_after": agent_pid(root),
            "server_before": server, "server_after": server_pid(root),
            "answered": clients.answered, "failures": clients.failures}


def server_pid(root: Path) -> int:
    record = root / "fleet" / "local-cp" / "var" / "lib" / "llmgw" / "run" / "llmgw-server.pid"
    return json.loads(record.read_text())["pid"]


def live_replicas(root: Path, api: int) -> list[dict]:
    """The control plane's replicas, read with the admin certificate the playbook issued."""
    ctx = ssl.create_default_context(cafile=str(root / "pki" / "ca.crt"))
    ctx.load_cert_chain(str(root / "pki" / "admin.crt"), str(root / "pki" / "admin.key"))
    with urllib.request.urlopen(f"https://127.0.0.1:{api}/v1/replicas", context=ctx, timeout=10) as response:
        return json.load(response)["replicas"]


def change_the_catalog(root: Path, api: int, extravars: dict) -> dict:
    """site.yml with one replica of the small model fewer: server.yaml changes, nothing else."""
    before = server_pid(root)
    deployments = [
        {"model": "qwen2.5-0.5b-instruct", "profile": "vllm-tp1", "replicas": 1},
        {"model": "qwen2.5-7b-instruct", "profile": "vllm-tp2", "replicas": 1},
    ]
    run = run_playbook(SITE, root / "runs", inventory=INVENTORY, extravars={**extravars, "llmgw_deployments": deployments})
    small = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        small = [r for r in live_replicas(root, api) if r["model"] == "qwen2.5-0.5b-instruct"]
        if len(small) == 1:
            break
        time.sleep(0.5)
    return {"run": run, "server_before": before, "server_after": server_pid(root), "small_replicas": small}


def test_check_mode_on_a_fresh_machine_changes_nothing(site):
    run = site["check-fresh"]
    assert run.rc == 0, run.explain()
    assert run.changed() > 0
    assert site["wrote-in-check"] == []


def test_site_converges_and_the_fleet_serves(site):
    run = site["apply"]
    assert run.rc == 0, run.explain()
    (ready,) = run.task("Wait until every declared replica is Ready")
    assert ready.status == "ok"
    states = [(r["model"], r["profile"], r["state"]) for r in ready.res["json"]["replicas"]]
    assert states.count(("qwen2.5-0.5b-instruct", "vllm-tp1", "ready")) == 2, states
    assert states.count(("qwen2.5-7b-instruct", "vllm-tp2", "ready")) == 1, states
    (completion,) = run.task("Send one chat completion through the router")
    assert completion.status == "ok" and completion.res["json"]["choices"], completion.res


def test_a_second_run_changes_nothing(site):
    run = site["apply-again"]
    assert run.rc == 0, run.explain()
    assert run.changed() == 0, run.explain()


def test_check_mode_on_the_converged_fleet_changes_nothing(site):
    run = site["check-again"]
    assert run.rc == 0, run.explain()
    assert run.changed() == 0, run.explain()


def test_upgrading_an_agent_does_not_interrupt_serving(site):
    upgrade = site["upgrade"]
    run = upgrade["run"]
    assert run.rc == 0, run.explain()
    assert any(r.changed for r in run.task("Install the wheel and its dependencies", "local-gpu0")), run.explain()
    assert upgrade["server_after"] == upgrade["server_before"], run.explain()  # its package did not change
    assert upgrade["agent_after"] != upgrade["agent_before"]  # the agent was replaced ...
    assert upgrade["engines_before"] and upgrade["engines_after"] == upgrade["engines_before"]  # ... its engines were not
    assert upgrade["failures"] == [] and upgrade["answered"] > 0, upgrade
    (ready,) = run.task("Wait until every declared replica is Ready")
    assert ready.status == "ok"


def test_a_catalog_change_reloads_the_running_control_plane(site):
    change = site["catalog"]
    run = change["run"]
    assert run.rc == 0, run.explain()
    assert sorted(run.changed_tasks()) == [
        "local-cp: Reload llmgw-server (plain process)", "local-cp: Render server.yaml"], run.explain()
    (reload,) = run.task("Reload llmgw-server (plain process)")
    assert reload.res["action"] == "reloaded"
    assert change["server_after"] == change["server_before"]  # signalled, not restarted
    assert len(change["small_replicas"]) == 1, change["small_replicas"]  # and the new catalog is in force
