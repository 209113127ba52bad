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


def write_atomic(path: str | os.PathLike[str], data: bytes, *, mode: int, overwrite: bool = True,
                 tmp_name: str | None = None) -> Path:
    """Write ``data`` to ``path`` atomically with exactly ``mode``.

    With ``overwrite=False`` an existing target raises ``FileExistsError`` and
    is left untouched, even when another writer races us (the final step is a
    hard link, which fails on an existing name instead of replacing it).

    ``tmp_name`` names the temporary file beside the target (default: a random
    hidden name).  A caller whose orphan sweep recognises a dead writer's
    leftover by its name (the weight fetcher's ``<name>.tmp<pid>``) passes its
    own; the name is then the caller's alone, so a leftover under it is
    truncated, not refused.
    """
    target = Path(path)
    directory = target.parent
    tmp = directory / (tmp_name or f".{target.name}.{secrets.token_hex(6)}.tmp")
    exclusive = os.O_TRUNC if tmp_name else os.O_EXCL
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | exclusive | getattr(os, "O_CLOEXEC", 0), mode)
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
