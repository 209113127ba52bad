"""Durable, permission-correct writes: keys, certificates, the agent's shard records.

A private key must never exist on disk, even for an instant, with a mode wider
than 0600, and a reader must never see half a file. So every write goes to a
temporary file beside the target, created by ``os.open`` with its final mode,
fsynced, then renamed (or hard-linked, when overwriting is refused) into place,
and the directory is fsynced so the rename survives a crash.
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


def write_private(path: str | os.PathLike[str], data: bytes, *, overwrite: bool = True) -> Path:
    """Write a private key: mode 0600 from the first byte."""
    return write_atomic(path, data, mode=PRIVATE_MODE, overwrite=overwrite)


def write_public(path: str | os.PathLike[str], data: bytes, *, overwrite: bool = True) -> Path:
    """Write a certificate: world-readable, still atomic."""
    return write_atomic(path, data, mode=PUBLIC_MODE, overwrite=overwrite)


def pair_paths(prefix: str | os.PathLike[str]) -> tuple[Path, Path]:
    """``PREFIX.crt`` and ``PREFIX.key`` for an output prefix."""
    p = Path(prefix)
    return p.with_name(p.name + ".crt"), p.with_name(p.name + ".key")


def write_pair(prefix: str | os.PathLike[str], cert_pem: bytes, key_pem: bytes) -> tuple[Path, Path]:
    """Write ``PREFIX.key`` (0600) then ``PREFIX.crt`` (0644).

    The key goes first so that a process reloading the pair mid-rotation sees,
    at worst, a new key with the old certificate, which fails loudly on load
    ("key values mismatch") rather than silently serving the wrong identity.
    """
    crt, key = pair_paths(prefix)
    crt.parent.mkdir(parents=True, exist_ok=True)
    write_private(key, key_pem)
    write_public(crt, cert_pem)
    return crt, key


def private_mode_problem(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` is not safe to hold a private key, or None when it is."""
    st = os.stat(path)
    if st.st_mode & 0o077:
        return f"{path} is accessible by group or others (mode {st.st_mode & 0o777:04o}); run: chmod 600 {path}"
    return None
