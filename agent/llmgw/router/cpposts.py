"""A router worker's periodic posts to the control plane (ejections, load): one post, and its problems logged once.

Each report is re-sent whole at its next interval, so a failed post is not
retried: it is logged when its kind of failure first appears and when posts
succeed again, not every interval.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp


async def post_report(session: aiohttp.ClientSession, target: str, body: dict[str, Any]) -> str:
    """POST ``body``; "" when the control plane took it (202), else what went wrong."""
    try:
        async with session.post(target, json=body) as r:
            if r.status != 202:
                text = (await r.content.read(300)).decode("utf-8", "replace")
                return f"HTTP {r.status}: {text}"
    except asyncio.CancelledError:
        raise
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
        return f"{type(e).__name__}: {e}"
    return ""


class ProblemLog:
    """Logs a report's failures once per kind, and its recovery."""

    def __init__(self, log: logging.Logger, target: str) -> None:
        self.log, self.target = log, target
        self.last = ""

    def note(self, problem: str, failing: str) -> None:
        """``problem`` from ``post_report``; ``failing``: the warning's text after the problem."""
        if problem and problem != self.last:
            self.log.warning("cannot report to %s: %s; %s", self.target, problem, failing)
        elif not problem and self.last:
            self.log.info("reporting to %s again", self.target)
        self.last = problem
