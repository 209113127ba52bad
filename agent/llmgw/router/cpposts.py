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


class ReportPoster:
    """One route's posts: the control planes' addresses (the one posted to now first) and the log of
    what went wrong, once per kind of failure and once on recovery."""

    def __init__(self, urls: Sequence[str], path: str, log: logging.Logger) -> None:
        self.targets = [u.rstrip("/") + path for u in urls]
        self.i = 0
        self.log = log
        self.last = ""  # the last post's problem ("" when it was taken)

    @property
    def current(self) -> str:
        return self.targets[self.i]

    async def post(self, session: aiohttp.ClientSession, body: dict[str, Any], failing: str) -> str:
        """POST ``body`` to the current control plane; "" when it took it (202), else what went wrong,
        logged with ``failing`` after it. The next post goes to the next address when this one was
        unreachable or could not take it (5xx, 404)."""
        target = self.current
        problem = await self._post(session, target, body)
        if problem and problem != self.last:
            self.log.warning("cannot report to %s: %s; %s", target, problem, failing)
        elif not problem and self.last:
            self.log.info("reporting to %s again", target)
        self.last = problem
        return problem

    async def _post(self, session: aiohttp.ClientSession, target: str, body: dict[str, Any]) -> str:
        try:
            async with session.post(target, json=body) as r:
                if r.status != 202:
                    text = (await r.content.read(300)).decode("utf-8", "replace")
                    if r.status >= 500 or r.status == 404:
                        self._next()
                    return f"HTTP {r.status}: {text}"
        except asyncio.CancelledError:
            raise
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
            self._next()
            return f"{type(e).__name__}: {e}"
        return ""

    def _next(self) -> None:
        self.i = (self.i + 1) % len(self.targets)
