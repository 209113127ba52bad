"""The integration suite's CPU-heavy group names files that exist, and xdist really keeps a
group on one worker: a renamed file, or a pytest/xdist pair that ignores the group, would
otherwise let the heavy files run side by side (and build their module fixtures once per
worker) without anything failing."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
INTEGRATION = REPO / "tests" / "integration"


def test_every_cpu_heavy_file_exists():
    spec = importlib.util.spec_from_file_location("integration_conftest", INTEGRATION / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    missing = sorted(name for name in module.CPU_HEAVY if not (INTEGRATION / name).is_file())
    assert not missing, f"tests/integration/conftest.py CPU_HEAVY names files that do not exist: {missing}"


MODULE = """
import os

def test_{i}():
    with open("workers.log", "a") as f:
        f.write(__name__ + " " + os.environ["PYTEST_XDIST_WORKER"] + "\\n")
"""


def run_like_make_test(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "agent")])}
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup",
                          "-p", "no:cacheprovider", str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout + res.stderr


def test_xdist_keeps_the_cpu_heavy_group_on_one_worker(tmp_path):
    """The integration conftest itself, run through pytest-xdist on two files of the group and one
    outside it, as `make test` runs the suite."""
    (tmp_path / "conftest.py").write_text((INTEGRATION / "conftest.py").read_text())
    for name in ("test_chaos", "test_fleet_sim", "test_light"):
        (tmp_path / f"{name}.py").write_text("".join(MODULE.format(i=i) for i in range(4)))
    run_like_make_test(tmp_path)
    seen: dict[str, set[str]] = {}
    for line in (tmp_path / "workers.log").read_text().splitlines():
        module, worker = line.split()
        seen.setdefault(module, set()).add(worker)
    heavy = seen["test_chaos"] | seen["test_fleet_sim"]
    assert len(heavy) == 1, f"the group's tests ran on {sorted(heavy)}: --dist loadgroup did not group them"
    assert len(seen["test_light"]) == 1  # a file outside the group stays on one worker too


SESSION = """
import subprocess, time
from tests.support.cpushare import autogroup_nice

def test_an_engine_in_a_session_of_its_own():
    engine = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        end = time.monotonic() + {wait}
        while time.monotonic() < end and autogroup_nice(engine.pid) == 0:
            time.sleep(0.1)
        with open("groups.log", "a") as f:
            f.write(__name__ + " " + str(autogroup_nice(engine.pid)) + "\\n")
    finally:
        engine.kill()
        engine.wait()
"""


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="this kernel does not group tasks by session")
def test_a_heavy_files_engines_in_sessions_of_their_own_are_niced_as_groups(tmp_path):
    """A heavy file's process in its own session (as the agent starts every engine) gets the heavy
    niceness for its whole autogroup, where its task niceness alone would not lower it; a light
    file's stays at the default."""
    from tests.support.cpushare import autogroup_nice
    if autogroup_nice(os.getpid()) != 0:
        pytest.skip("this process's own autogroup is niced: nothing to compare against")
    (tmp_path / "conftest.py").write_text((INTEGRATION / "conftest.py").read_text())
    (tmp_path / "test_vllm_e2e.py").write_text(SESSION.format(wait=15))
    (tmp_path / "test_light.py").write_text(SESSION.format(wait=2))
    run_like_make_test(tmp_path)
    groups = dict(line.split() for line in (tmp_path / "groups.log").read_text().splitlines())
    assert groups == {"test_vllm_e2e": "10", "test_light": "0"}
