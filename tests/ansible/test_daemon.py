"""llmgw.fleet.daemon through ansible-playbook, with a real background process.

started and stopped each go through check, apply, check, apply (changed,
changed, unchanged, unchanged), and check mode never touches the process;
reloaded delivers SIGHUP to the same process; a pid recorded for a process
that is gone (or belongs to someone else now) is never signalled; a command
that exits at once fails with its output, one that cannot be executed with the reason.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleet_harness import PLAYBOOKS, four_runs, run_playbook

from tests.support import procfs

PLAY = PLAYBOOKS / "daemon.yml"
SERVICE = """
import os, signal, sys, time
events = sys.argv[1]
def note(what):
    with open(events, "a") as f:
        f.write(f"{what} {os.getpid()}\\n")
signal.signal(signal.SIGHUP, lambda *a: note("hup"))
signal.signal(signal.SIGTERM, lambda *a: (note("term"), sys.exit(0)))
note("start")
while True:
    time.sleep(0.1)
"""


def events(workdir: Path) -> list[str]:
    path = workdir / "events"
    return path.read_text().split("\n")[:-1] if path.exists() else []


def alive(pid: int) -> bool:
    """Whether ``pid`` runs. A zombie has exited: the service was started by a module
    process that is gone, so the exited process waits for init to reap it, whenever
    init gets to it, and os.kill(pid, 0) would still succeed on it."""
    return procfs.alive(pid)


@pytest.fixture
def workdir(tmp_path):
    (tmp_path / "service.py").write_text(SERVICE)
    yield tmp_path
    record = tmp_path / "run" / "service.pid"
    if record.exists():
        pid = json.loads(record.read_text())["pid"]
        if alive(pid) and f"{tmp_path}/service.py" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
            os.kill(pid, signal.SIGKILL)


def run(workdir, *states, **kw):
    cases = [{"name": "svc", "state": s} for s in states]
    return run_playbook(PLAY, workdir / "runs", extravars={"cases": cases, "workdir": str(workdir)}, **kw)


def test_started_then_stopped_converge(workdir):
    runs = four_runs(PLAY, workdir / "runs", extravars={"cases": [{"name": "svc", "state": "started"}], "workdir": str(workdir)})
    assert [r.rc for r in runs] == [0, 0, 0, 0], runs[0].explain()
    assert [r.changed() for r in runs] == [1, 1, 0, 0]  # the first check started nothing, so the apply still changes
    starts = [e for e in events(workdir) if e.startswith("start")]
    assert len(starts) == 1, events(workdir)  # check runs never started one
    pid = int(starts[0].split()[1])
    assert alive(pid)
    assert runs[3].task("Manage the service")[0].res["pid"] == pid

    stops = four_runs(PLAY, workdir / "runs", extravars={"cases": [{"name": "svc", "state": "stopped"}], "workdir": str(workdir)})
    assert [r.changed() for r in stops] == [1, 1, 0, 0]
    assert events(workdir) == [f"start {pid}", f"term {pid}"]
    assert not (workdir / "run" / "service.pid").exists()


def test_reload_signals_the_same_process_and_restart_replaces_it(workdir):
    first = run(workdir, "started", "reloaded", "reloaded")
    assert first.rc == 0 and first.changed() == 3, first.explain()
    pid = int(events(workdir)[0].split()[1])
    deadline = time.monotonic() + 30
    while events(workdir).count(f"hup {pid}") < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert events(workdir) == [f"start {pid}", f"hup {pid}", f"hup {pid}"]
    check = run(workdir, "reloaded", "restarted", check=True)
    assert check.changed() == 2 and events(workdir) == [f"start {pid}", f"hup {pid}", f"hup {pid}"]
    again = run(workdir, "restarted")
    assert again.changed() == 1
    new_pid = again.task("Manage the service")[0].res["pid"]
    assert new_pid != pid and alive(new_pid) and not alive(pid)
    run(workdir, "stopped")


def test_a_recorded_pid_of_another_process_is_never_signalled(workdir):
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        (workdir / "run").mkdir()
        # The pid is live, but its start time is not the recorded one: it is someone else.
        (workdir / "run" / "service.pid").write_text(json.dumps({"pid": bystander.pid, "start_time": 1, "boot_id": "x"}))
        result = run(workdir, "stopped", "started")
        assert result.rc == 0, result.explain()
        stopped, started = result.task("Manage the service")
        assert not stopped.changed  # nothing of ours ran, so nothing was stopped
        assert started.changed and started.res["pid"] != bystander.pid
        assert bystander.poll() is None
        run(workdir, "stopped")
    finally:
        bystander.kill()
        bystander.wait()


def test_a_command_that_exits_at_once_fails_with_its_output(workdir):
    (workdir / "service.py").write_text("import sys; print('cannot bind 127.0.0.1:1'); sys.exit(3)\n")
    result = run(workdir, "started")
    assert result.rc != 0
    (failed,) = result.task("Manage the service")
    assert failed.status == "failed"
    assert "svc exited with status 3 right after it started" in failed.res["msg"]
    assert "cannot bind 127.0.0.1:1" in failed.res["msg"]


def test_a_command_that_cannot_be_executed_fails_with_the_reason(workdir):
    missing = str(workdir / "no-such-binary")
    result = run_playbook(PLAY, workdir / "runs", extravars={
        "cases": [{"name": "svc", "state": "started", "command": [missing, "serve"]}], "workdir": str(workdir)})
    assert result.rc != 0
    (failed,) = result.task("Manage the service")
    assert failed.status == "failed"
    assert failed.res["msg"].startswith(f"svc: cannot start {missing}: "), failed.res["msg"]
    assert "No such file or directory" in failed.res["msg"]
    assert not (workdir / "run" / "service.pid").exists()
