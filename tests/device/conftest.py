"""The device tests drive the same real-process fleet as tests/integration."""

from __future__ import annotations

import sys
from pathlib import Path

INTEGRATION = Path(__file__).resolve().parent.parent / "integration"
if str(INTEGRATION) not in sys.path:
    sys.path.insert(0, str(INTEGRATION))
