"""The inventory plugin's tests reuse the fleet of tests/integration and the
playbook runner of tests/ansible."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for extra in (HERE, HERE.parent / "integration", HERE.parent / "ansible"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

# ansible-runner looks ansible-inventory up on PATH: make it this virtualenv's.
import os  # noqa: E402

_BIN = str(Path(sys.executable).parent)
if not os.environ.get("PATH", "").startswith(_BIN + os.pathsep):
    os.environ["PATH"] = f"{_BIN}{os.pathsep}{os.environ.get('PATH', '')}"
