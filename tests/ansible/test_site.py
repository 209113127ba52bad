"""playbooks/site.yml against inventory/local, through ansible-playbook: the whole
all-in-one fleet (control plane + router, one agent with simulated GPUs, the
engine simulator) on this machine, in a private directory and on free ports.

check mode on a fresh machine writes nothing; the first run converges and its
last play proves every declared replica Ready and a chat completion answered
through the router; a second run and a second check change nothing. Then a new
build of the package reaches the node and playbooks/upgrade.yml replaces its
agent while clients keep sending completions: not one fails, and every engine
keeps running under the new agent, and the control plane, upgraded last, is
left alone because its package did not change. A catalog change (one replica
fewer) reloads the running control plane (SIGHUP, same process), which applies
it, and leaves the agent alone; an agent.yaml change restarts the agent (new
process) and leaves the control plane and the engines alone.

Then what must fail does, and says why: documents the runtime refuses (a broken
timing invariant in server.yaml, a broken backoff in agent.yaml; both pass the
preflight's schema check, so the template tasks' `validate:` is what stops
them) fail at the task rendering them, naming the JSON pointer, and leave the
installed files byte for byte; and a deployment whose weights do not exist
makes the final readiness check fail, naming the deployment and the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from fleet_harness import REPO, run_playbook

from tests.support.ports import free_port
from tests.support.procfs import processes_under

SITE = REPO / "playbooks" / "site.yml"
UPGRADE = REPO / "playbooks" / "upgrade.yml"
INVENTORY = REPO / "inventory" / "local" / "hosts.yml"
LOCAL_SERVER = yaml.safe_load((REPO / "inventory" / "local" / "files" / "server.yaml").read_text())
# The catalog after change_the_catalog: one replica of the small model fewer.
FEWER = [
    {"model": "qwen2.5-0.5b-instruct", "profile": "vllm-tp1", "replicas": 1},
    {"model": "qwen2.5-7b-instruct", "profile": "vllm-tp2", "replicas": 1},
]
# An agent.yaml setting that changes nothing the running engines depend on.
AGENT_EXTRA = {"fetch": {"stall_timeout": 30}}
MISSING_WEIGHTS = "/nonexistent/llmgw-site-test/missing-weights"
# The module fixture is eleven ansible-playbook runs (about ten minutes on two cores, twice that
# under load); it counts against the first test's limit.
pytestmark = pytest.mark.timeout(2700)


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
        runs["wheels-after-check"] = sorted((source / "build" / "llmgw-wheel").glob("*.whl"))
        runs["apply"] = run_playbook(SITE, root / "runs", inventory=INVENTORY, extravars=extravars)
        runs["apply-again"] = run_playbook(SITE, root / "runs", inventory=INVENTORY, extravars=extravars)
        runs["check-again"] = run_playbook(SITE, root / "runs", inventory=INVENTORY, extravars=extravars, check=True, diff=True)
        if runs["apply"].rc == 0:
            runs["upgrade"] = upgrade_while_serving(root, router, extravars)
            runs["upgrade-agents-only"] = run_playbook(
                UPGRADE, root / "runs", inventory=INVENTORY, extravars=extravars, limit="llmgw_agents", check=True)
            runs["catalog"] = change_the_catalog(root, api, extravars)
            runs["agent-config"] = change_the_agent_config(root, extravars)
            runs["invalid"] = render_invalid_documents(root, extravars)
            runs["unready"] = declare_weights_that_do_not_exist(root, extravars)
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

    def __init__(self, port: int, ca: Path) -> None:
        super().__init__(daemon=True)
        self.url = f"https://127.0.0.1:{port}/v1/chat/completions"  # the fleet router certificate
        self.context = ssl.create_default_context(cafile=str(ca))
        self.stopping = threading.Event()
        self.answered = 0
        self.failures: list[str] = []

    def run(self) -> None:
        body = json.dumps({"model": "qwen2.5-0.5b-instruct", "max_tokens": 4,
                           "messages": [{"role": "user", "content": "Say hello."}]}).encode()
        while not self.stopping.is_set():
            request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=30, context=self.context) as response:
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
    clients = Clients(router, root / "pki" / "ca.crt")
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
    before, agent = server_pid(root), agent_pid(root)
    run = run_playbook(SITE, root / "runs", inventory=INVENTORY, extravars={**extravars, "llmgw_deployments": FEWER})
    small = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        small = [r for r in live_replicas(root, api) if r["model"] == "qwen2.5-0.5b-instruct"]
        if len(small) == 1:
            break
        time.sleep(0.5)
    return {"run": run, "server_before": before, "server_after": server_pid(root), "small_replicas": small,
            "agent_before": agent, "agent_after": agent_pid(root)}


def installed(root: Path) -> dict[str, bytes]:
    return {"server.yaml": (root / "fleet" / "local-cp" / "etc" / "llmgw" / "server.yaml").read_bytes(),
            "agent.yaml": (root / "fleet" / "local-gpu0" / "etc" / "llmgw" / "agent.yaml").read_bytes()}


def change_the_agent_config(root: Path, extravars: dict) -> dict:
    """site.yml with one agent.yaml setting changed (and the catalog as change_the_catalog left it)."""
    before = {"agent": agent_pid(root), "server": server_pid(root), "engines": engine_pids(root), "files": installed(root)}
    run = run_playbook(SITE, root / "runs", inventory=INVENTORY,
                       extravars={**extravars, "llmgw_deployments": FEWER, "llmgw_agent_config_extra": AGENT_EXTRA})
    after = {"agent": agent_pid(root), "server": server_pid(root), "engines": engine_pids(root), "files": installed(root)}
    return {"run": run, "before": before, "after": after}


def render_invalid_documents(root: Path, extravars: dict) -> dict:
    """site.yml with a server.yaml, then with an agent.yaml, that is valid JSON Schema-wise (so
    preflight lets it through) but that the runtime refuses: only `validate:` stops it. Two
    runs, because a play whose every host failed (the control plane's) ends the playbook."""
    lifecycle = {**LOCAL_SERVER["lifecycle"], "unreachable_after": 6}  # <= keepalive 5 + heartbeat 2
    agent_extra = {"fetch": {**AGENT_EXTRA["fetch"], "backoff_initial": 10, "backoff_max": 5}}
    out = {}
    for document, broken in (("server.yaml", {"llmgw_lifecycle": lifecycle}),
                             ("agent.yaml", {"llmgw_agent_config_extra": agent_extra})):
        before = {"agent": agent_pid(root), "server": server_pid(root), "files": installed(root)}
        run = run_playbook(SITE, root / "runs", inventory=INVENTORY, extravars={
            **extravars, "llmgw_deployments": FEWER, "llmgw_agent_config_extra": AGENT_EXTRA, **broken})
        after = {"agent": agent_pid(root), "server": server_pid(root), "files": installed(root)}
        out[document] = {"run": run, "before": before, "after": after}
    return out


def declare_weights_that_do_not_exist(root: Path, extravars: dict) -> dict:
    """site.yml with one more deployment, of a model whose weights are a path that does not
    exist, and a short wait: the last play fails saying which deployment and why."""
    models = LOCAL_SERVER["models"] + [{"name": "missing-weights", "source": MISSING_WEIGHTS, "size_bytes": 1000000}]
    deployments = FEWER + [{"model": "missing-weights", "profile": "vllm-tp1", "replicas": 1}]
    started = time.monotonic()
    run = run_playbook(SITE, root / "runs", inventory=INVENTORY, extravars={
        **extravars, "llmgw_models": models, "llmgw_deployments": deployments,
        "llmgw_agent_config_extra": AGENT_EXTRA, "llmgw_verify_retries": 15, "llmgw_verify_delay": 1})
    return {"run": run, "seconds": time.monotonic() - started}


def test_check_mode_on_a_fresh_machine_changes_nothing(site):
    run = site["check-fresh"]
    assert run.rc == 0, run.explain()
    assert run.changed() > 0
    assert site["wrote-in-check"] == []


def test_check_mode_says_so_when_it_builds_the_wheel_on_the_controller(site):
    """The wheel is built in check mode too (the hosts' copy is compared with it); a
    build that leaves a new wheel on the controller is reported as a change, and one
    that leaves the same wheel is not."""
    assert site["wheels-after-check"], "check mode built no wheel"
    def build(run):  # built once per run, by the first play that installs the runtime
        (report,) = [r for r in run.task("Report whether the build replaced the earlier one") if r.status != "skipped"]
        return report

    assert build(site["check-fresh"]).changed, build(site["check-fresh"]).res
    for name in ("apply-again", "check-again"):
        again = build(site[name])
        assert again.status == "ok" and not again.changed, (name, again.res)


def test_site_converges_and_the_fleet_serves(site):
    run = site["apply"]
    assert run.rc == 0, run.explain()
    (ready,) = run.task("Wait until every declared replica is Ready")
    assert ready.status == "ok"
    states = [(r["model"], r["profile"], r["state"]) for r in ready.res["json"]["replicas"]]
    assert states.count(("qwen2.5-0.5b-instruct", "vllm-tp1", "ready")) == 2, states
    assert states.count(("qwen2.5-7b-instruct", "vllm-tp2", "ready")) == 1, states
    (completion,) = run.task("Send one chat completion through each router")
    assert completion.status == "ok" and completion.res["json"]["choices"], completion.res
    assert completion.res["url"].startswith("https://127.0.0.1:"), "HTTPS with the fleet router certificate"


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


def test_the_control_plane_is_upgraded_last_and_says_whether_the_router_is_interrupted(site):
    run = site["upgrade"]["run"]
    hosts = [r.host for r in run.results if r.task == "Record whether the package changed"]
    assert hosts == ["local-gpu0", "local-cp"], hosts  # agents first, the control plane last
    (plan,) = run.task("Say what this run upgrades")
    assert "Agents (local-gpu0)" in plan.res["msg"] and "Control plane (local-cp): last" in plan.res["msg"], plan.res
    assert "refuses connections" in plan.res["msg"]
    (warning,) = run.task("Warn that the router is about to be interrupted", "local-cp")
    assert "not restarted, the router is not interrupted" in warning.res["msg"], warning.res  # same package
    assert not run.task("Restart llmgw-server (plain process)")


def test_an_upgrade_limited_to_the_agents_leaves_the_control_plane_alone(site):
    run = site["upgrade-agents-only"]
    assert run.rc == 0, run.explain()
    assert sorted({r.host for r in run.results}) == ["local-gpu0"], sorted({r.host for r in run.results})
    (plan,) = run.task("Say what this run upgrades")
    assert "Control plane: not in this run" in plan.res["msg"], plan.res


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
    assert change["agent_after"] == change["agent_before"]  # a catalog change is none of the agent's business


def test_an_agent_yaml_change_restarts_the_agent_and_nothing_else(site):
    change = site["agent-config"]
    run, before, after = change["run"], change["before"], change["after"]
    assert run.rc == 0, run.explain()
    assert sorted(run.changed_tasks()) == [
        "local-gpu0: Render agent.yaml", "local-gpu0: Restart llmgw-agent (plain process)"], run.explain()
    (restart,) = run.task("Restart llmgw-agent (plain process)")
    assert restart.res["action"] == "restarted", restart.res
    assert after["agent"] != before["agent"]  # a new agent process reads the new agent.yaml ...
    assert b"stall_timeout: 30" in after["files"]["agent.yaml"] and b"stall_timeout" not in before["files"]["agent.yaml"]
    assert after["server"] == before["server"] and after["files"]["server.yaml"] == before["files"]["server.yaml"]
    assert before["engines"] and after["engines"] == before["engines"]  # ... and adopts the running engines
    (ready,) = run.task("Wait until every declared replica is Ready")
    assert ready.status == "ok"


@pytest.mark.parametrize("document, host, message", [
    ("server.yaml", "local-cp", "/lifecycle/unreachable_after: must exceed keepalive_interval + heartbeat_interval"),
    ("agent.yaml", "local-gpu0", "/fetch/backoff_max: must be >= backoff_initial (10)"),
])
def test_a_document_the_runtime_refuses_fails_at_its_template_and_leaves_the_installed_file(site, document, host, message):
    change = site["invalid"][document]
    run, before, after = change["run"], change["before"], change["after"]
    assert run.rc != 0, run.explain()
    # Preflight (JSON Schema) let it through: what refuses it is the template's `validate:`.
    assert [r.status for r in run.task("Refuse an invalid declared fleet")] == ["ok", "ok"], run.explain()
    (render,) = run.task(f"Render {document}", host)
    assert render.status == "failed", render.res
    assert render.res["msg"] == "failed to validate", render.res
    assert message in render.res["stderr"], render.res  # the runtime's own words, with the JSON pointer
    assert message in run.stdout, run.explain()  # as the operator sees it
    # Nothing was replaced, reloaded or restarted.
    assert after["files"] == before["files"]
    assert after["server"] == before["server"] and after["agent"] == before["agent"]
    assert run.changed_tasks() == [], run.explain()
    assert not [r for r in run.results if r.task.startswith(("Reload llmgw", "Restart llmgw"))], run.explain()


def test_a_deployment_that_cannot_start_fails_the_last_play_naming_it_and_why(site):
    change = site["unready"]
    run = change["run"]
    assert run.rc != 0, run.explain()
    reports = run.task("Report what is not Ready")
    assert len(reports) == 1, run.explain()  # the run failed before its report: say where
    (report,) = reports
    assert report.status == "failed", report.res
    message = report.res["msg"]
    assert "the fleet did not reach its declared replicas in time" in message, message
    assert "Short: missing-weights/vllm-tp1: 0 of 1 Ready." in message, message  # that deployment alone ...
    assert f"{MISSING_WEIGHTS} does not exist" in message, message  # ... and why (the shard's reason)
    assert not run.task("Send one chat completion through each router")
    assert change["seconds"] < 180, change["seconds"]
