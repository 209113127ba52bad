"""Durable writes: a reader never sees half a file, and a crash never loses a rename.

Every write goes to a temporary file beside the target, created by
``os.open`` with its final mode, fsynced, then renamed (or hard-linked, when
overwriting is refused) into place, and the directory is fsynced so the rename
survives a crash.  Keys and certificates (``llmgw.tls.files``), the agent's
shard records, downloaded weights and the fleet simulator's caches all use it.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

PRIVATE_MODE = 0o600
PUBLIC_MODE = 0o644


def write_atomic(path: str | os.PathLike[str], data: bytes, *, mode: int, overwrite: bool = True) -> Path:
    """Write ``data`` to ``path`` atomically with exactly ``mode``.

    With ``overwrite=False`` an existing target raises ``FileExistsError`` and
    is left untouched, even when another writer races us (the final step is a
    hard link, which fails on an existing name instead of replacing it).
    """
    target = Path(path)
    directory = target.parent
    tmp = directory / f".{target.name}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode)
    try:
        try:
            os.fchmod(fd, mode)  # the umask may have narrowed it; make it exact
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        if overwrite:
            os.replace(tmp, target)
        else:
            os.link(tmp, target)
            os.unlink(tmp)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(directory)
    return target


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Persist a directory entry change (rename, link) across a crash."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
