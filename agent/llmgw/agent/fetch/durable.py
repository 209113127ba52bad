"""File-system steps whose order is the whole point.

A finished download becomes visible in exactly one step: ``rename`` of a
complete, fsync'd, verified file onto the final name, followed by an fsync
of the directory so the rename itself survives a power loss.  Before that
step the final name does not exist (or still holds the previous complete
file); after it, it holds the new one.  There is no moment in between, so
nothing that reads the directory (an engine, a scan, a second node on a
shared mount) can see half a file under the model's name.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from llmgw.agent.fetch import naming
from llmgw.agent.fetch.resume import Meta
from llmgw.durable import PUBLIC_MODE, fsync_dir, write_atomic

HASH_BLOCK = 8 << 20


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged writer may still use in ``directory``'s file system."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def promote(partial: Path, final: Path) -> None:
    """Make a complete, fsync'd file visible under its final name, durably."""
    os.rename(partial, final)
    fsync_dir(final.parent)


def sha256_file(path: Path) -> str:
    """Digest of what is on disk (not of what we believe we wrote).  Blocking: run it in a thread."""
    h = hashlib.sha256()
    buf = bytearray(HASH_BLOCK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def write_text(path: Path, text: str) -> None:
    """Replace a small file (a sidecar, a stamp, a manifest copy) in one step.

    ``llmgw.durable.write_atomic`` under the fetcher's tmp name: a write that
    fails (ENOSPC is the usual one: the tmp file is created, its first page is
    not) removes its tmp file before raising.  Only a process killed inside it
    leaves one behind, under a name that ``naming.is_scratch`` recognises and
    ``scratch.sweep_orphans`` removes once its writer is dead.
    """
    write_atomic(path, text.encode(), mode=PUBLIC_MODE, tmp_name=naming.tmp_name(path.name, os.getpid()))


def read_meta(path: Path) -> Meta | None:
    try:
        return Meta.from_json(path.read_text())
    except OSError:
        return None


def remove(*paths: Path) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def stamp_text(path: Path, sha256: str) -> str | None:
    """What a verified stamp for ``path`` says: its digest and the stat fields that would change with it."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return f"{sha256} {st.st_size} {st.st_mtime_ns} {st.st_ino}\n"
