"""The ansible-test internals lint.sh relies on to run sanity offline, named (ansible_test_bootstrap)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import ansible_test_bootstrap as bootstrap

HERE = Path(__file__).resolve().parent


def test_ansible_test__internal_python_requirements_names_the_pip_it_bootstraps():
    assert re.fullmatch(r"\d+(\.\d+)+", bootstrap.pip_version()), \
        "ansible_test._internal.python_requirements no longer names pip='X.Y'"


def test_ansible_tests_setup_script_reads_the_cache_path_lint_sh_writes():
    source = bootstrap.setup_script().read_text()
    assert f"os.path.expanduser('{bootstrap.CACHE_PATTERN}' % pip_version.replace(\".\", \"_\"))" in source, \
        "ansible_test/_util/target/setup/requirements.py reads its get-pip cache elsewhere: lint.sh's stand-in is unused"


def test_lint_sh_writes_the_path_this_module_prints():
    printed = subprocess.run([sys.executable, str(HERE / "ansible_test_bootstrap.py")], capture_output=True,
                             text=True, check=True).stdout.strip()
    assert printed == bootstrap.cache_path(bootstrap.pip_version())
    assert "ansible_test_bootstrap.py" in (HERE / "lint.sh").read_text()
