"""A router worker's posts to the control plane (ejections, load, wakes): one post, and its problems logged once.

Each report is re-sent whole at its next interval, so a failed post is not
retried: it is logged when its kind of failure first appears and when posts
succeed again, not every interval.  With several control planes (``ha``) a
post that finds nobody, or a control plane that cannot take it, moves the
next one to the next address; a standby redirects a post to its leader
(307), which the client follows.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import aiohttp


class Targets:
    """The control planes' addresses for one route, the one posted to now first."""

    def __init__(self, urls: Sequence[str], path: str) -> None:
        self.targets = [u.rstrip("/") + path for u in urls]
        self.i = 0

    @property
    def current(self) -> str:
        return self.targets[self.i]

    def next(self) -> None:
        """The current one could not take a post: the next address for the next post."""
        self.i = (self.i + 1) % len(self.targets)


async def post_report(session: aiohttp.ClientSession, targets: Targets, body: dict[str, Any]) -> str:
    """POST ``body`` to the current control plane; "" when it took it (202), else what went wrong (and
    the next post goes to the next address when it was unreachable or could not take it: 5xx, 404)."""
    try:
        async with session.post(targets.current, json=body) as r:
            if r.status != 202:
                text = (await r.content.read(300)).decode("utf-8", "replace")
                if r.status >= 500 or r.status == 404:
                    targets.next()
                return f"HTTP {r.status}: {text}"
    except asyncio.CancelledError:
        raise
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
        targets.next()
        return f"{type(e).__name__}: {e}"
    return ""


class ProblemLog:
    """Logs a report's failures once per kind, and its recovery."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self.last = ""

    def note(self, target: str, problem: str, failing: str) -> None:
        """``problem`` from ``post_report`` to ``target``; ``failing``: the warning's text after the problem."""
        if problem and problem != self.last:
            self.log.warning("cannot report to %s: %s; %s", target, problem, failing)
        elif not problem and self.last:
            self.log.info("reporting to %s again", target)
        self.last = problem
