"""The integration suite's CPU-heavy group names files that exist: a renamed file would
otherwise leave the group silently and run beside another heavy one."""

from __future__ import annotations

import importlib.util
from pathlib import Path

INTEGRATION = Path(__file__).resolve().parents[1] / "integration"


def test_every_cpu_heavy_file_exists():
    spec = importlib.util.spec_from_file_location("integration_conftest", INTEGRATION / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    missing = sorted(name for name in module.CPU_HEAVY if not (INTEGRATION / name).is_file())
    assert not missing, f"tests/integration/conftest.py CPU_HEAVY names files that do not exist: {missing}"
