"""An advisory lock per target, to save bandwidth, never relied on for correctness.

When two fetchers on one machine want the same file (two agents by
mistake, or a tool run beside the agent), the lock makes the second wait and
then find the file present instead of downloading it again.  Correctness
never depends on it: flock is a no-op on some parallel file systems and
does not span nodes, and a fetcher that gets no lock still writes only its
own partial file and promotes it by an atomic rename.  Tests patch
``acquire`` to a no-op to show exactly that.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from pathlib import Path
from typing import AsyncIterator

POLL = 0.2


async def acquire(path: Path) -> int | None:
    """An fd holding an exclusive flock on ``path`` (waits), or None if locking is unavailable."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            await asyncio.sleep(POLL)
        except OSError:  # ENOLCK and friends: proceed unlocked, which is safe
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise


@contextlib.asynccontextmanager
async def held(path: Path) -> AsyncIterator[None]:
    fd = await acquire(path)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)
