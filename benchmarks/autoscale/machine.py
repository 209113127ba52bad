"""What the autoscaling benchmarks say about where they ran, and how they write their results."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), for the results' header."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def write_results(out_dir: str | Path, stem: str, doc: dict[str, Any], md: str) -> None:
    """``stem``.json and ``stem``.md under ``out_dir``, each replaced whole."""
    from llmgw.durable import write_atomic  # noqa: PLC0415

    out = Path(out_dir)
    write_atomic(out / f"{stem}.json", (json.dumps(doc, indent=2) + "\n").encode(), mode=0o644)
    write_atomic(out / f"{stem}.md", md.encode(), mode=0o644)
