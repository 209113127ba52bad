"""An advisory lock per target, to save bandwidth, never relied on for correctness.

When two fetchers on one machine want the same file (two agents by
mistake, or a tool run beside the agent), the lock makes the second wait and
then find the file present instead of downloading it again.  Correctness
never depends on it: flock is a no-op on some parallel file systems and
does not span nodes, and a fetcher that gets no lock still writes only its
own partial file and promotes it by an atomic rename.  Tests patch
``acquire`` to a no-op to show exactly that.  The lock file exists only
while a fetch holds it.
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
    """An fd holding an exclusive flock on ``path`` (waits), or None if locking is unavailable.

    The holder removes the lock file when it lets go (``release``), so a
    waiter can end up holding a lock on a file that no longer has the name:
    that locks nothing, and it tries again on whatever the name leads to now.
    """
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return None
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    await asyncio.sleep(POLL)
            if _still_named(fd, path):
                return fd
        except OSError:  # ENOLCK and friends: proceed unlocked, which is safe
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _still_named(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def release(path: Path, fd: int) -> None:
    """Remove the lock file, then let go: nothing of the fetcher stays in the directory.

    Removed while still held, so no one can lock the old file after this and
    think it holds the lock (see ``acquire``).
    """
    try:
        os.unlink(path)
    except OSError:
        pass
    os.close(fd)


@contextlib.asynccontextmanager
async def held(path: Path) -> AsyncIterator[None]:
    fd = await acquire(path)
    try:
        yield
    finally:
        if fd is not None:
            release(path, fd)
