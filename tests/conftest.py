"""Every suite imports its shared support as a package (``tests.support``): the repository root
goes on the path, whichever directory pytest was pointed at."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
