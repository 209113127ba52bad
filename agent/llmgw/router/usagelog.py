"""The usage record: what each limited key used, per minute and model, appended to a file to bill from.

The Prometheus counters (``llmgw_router_key_*``) start again from zero when
a router restarts and keep no history; Prometheus' own retention and a
scrape that misses a worker's last seconds decide what a bill built on them
would say.  This record does not depend on either: every worker adds up the
requests and tokens it settled (``LimitsGate.finish``) per UTC minute, key
and model, and once that minute is over appends one JSON line per key and
model to ``usage_log``.  Each batch is one ``write`` on a file opened
``O_APPEND``, so the workers of a router (and routers sharing a directory
on a local filesystem) never interleave inside a line.  A worker writes what
it holds when it stops (SIGTERM); one that is killed loses at most its
current minute.  ``llmgw ctl keys usage`` reads and sums the lines.

A line: ``{"minute": "2026-12-06T03:27:00Z", "key": "team-a", "model": "m",
"requests": 3, "prompt_tokens": 30, "cached_prompt_tokens": 16,
"completion_tokens": 12, "router": "host", "pid": 4242}``.
``cached_prompt_tokens`` (part of ``prompt_tokens``) are those the engine
said it found in its prefix cache (``usage.prompt_tokens_details.cached_tokens``;
0 where it does not say), which providers bill at a discount.  Only keys with a ``limits`` block are accounted
(``limits: {}`` accounts without limiting).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from datetime import datetime, timezone
from typing import Callable

from llmgw.durable import PRIVATE_MODE

log = logging.getLogger("llmgw.router")


def minute_text(minute: int) -> str:
    return datetime.fromtimestamp(minute * 60, timezone.utc).strftime("%Y-%m-%dT%H:%M:00Z")


class UsageLog:
    def __init__(self, path: str, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.clock = clock
        self.router = socket.gethostname()
        self._minutes: dict[int, dict[tuple[str, str], list[int]]] = {}

    def add(self, key: str, model: str, prompt: int, completion: int, cached: int = 0) -> None:
        """Count one settled request (``cached``: of its prompt tokens, those the engine had cached);
        a minute already over is written now."""
        minute = int(self.clock() // 60)
        if self._minutes and min(self._minutes) < minute:
            self.flush(minute)
        row = self._minutes.setdefault(minute, {}).setdefault((key, model), [0, 0, 0, 0])
        row[0] += 1
        row[1] += prompt
        row[2] += completion
        row[3] += cached

    def flush(self, before: int | None = None) -> None:
        """Append every minute earlier than ``before`` (all of them when None) in one write."""
        done = sorted(m for m in self._minutes if before is None or m < before)
        if not done:
            return
        lines = []
        for m in done:
            for (key, model), (requests, prompt, completion, cached) in sorted(self._minutes[m].items()):
                lines.append(json.dumps({"minute": minute_text(m), "key": key, "model": model, "requests": requests,
                                         "prompt_tokens": prompt, "cached_prompt_tokens": cached,
                                         "completion_tokens": completion,
                                         "router": self.router, "pid": os.getpid()}, separators=(",", ":")))
        data = ("\n".join(lines) + "\n").encode()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), PRIVATE_MODE)
            try:
                written = os.write(fd, data)
            finally:
                os.close(fd)
        except OSError as e:
            log.error("usage record: cannot append to %s (kept in memory, tried again next minute): %s", self.path, e)
            return
        if written != len(data):  # a full disk: the reader skips the torn line, and says so
            log.error("usage record: %s took %d of %d bytes; the last line is torn", self.path, written, len(data))
        for m in done:
            del self._minutes[m]

    async def run(self) -> None:
        """Write each minute soon after it ends, even when no request comes to do it; all of it when cancelled."""
        try:
            while True:
                now = self.clock()
                await asyncio.sleep(60 - now % 60 + 0.5)
                self.flush(int(self.clock() // 60))
        finally:
            self.flush()
