"""What a process's log says went wrong."""

from __future__ import annotations

MARKS = ("Traceback", "Error handling request", "--- Logging error ---", "Task exception was never retrieved")


def tracebacks(text: str) -> list[str]:
    """Signs in a server log that an exception escaped a handler (or a log call)."""
    return [line for line in text.splitlines() if any(m in line for m in MARKS)]
