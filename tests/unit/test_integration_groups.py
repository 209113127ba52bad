"""The integration suite's CPU-heavy group names files that exist, and xdist really keeps a
group on one worker: a renamed file, or a pytest/xdist pair that ignores the group, would
otherwise let the heavy files run side by side (and build their module fixtures once per
worker) without anything failing."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

INTEGRATION = Path(__file__).resolve().parents[1] / "integration"


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


def test_xdist_keeps_the_cpu_heavy_group_on_one_worker(tmp_path):
    """The integration conftest itself, run through pytest-xdist on two files of the group and one
    outside it, as `make test` runs the suite."""
    (tmp_path / "conftest.py").write_text((INTEGRATION / "conftest.py").read_text())
    for name in ("test_chaos", "test_fleet_sim", "test_light"):
        (tmp_path / f"{name}.py").write_text("".join(MODULE.format(i=i) for i in range(4)))
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup",
                          "-p", "no:cacheprovider", str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    seen: dict[str, set[str]] = {}
    for line in (tmp_path / "workers.log").read_text().splitlines():
        module, worker = line.split()
        seen.setdefault(module, set()).add(worker)
    heavy = seen["test_chaos"] | seen["test_fleet_sim"]
    assert len(heavy) == 1, f"the group's tests ran on {sorted(heavy)}: --dist loadgroup did not group them"
    assert len(seen["test_light"]) == 1  # a file outside the group stays on one worker too
