"""Keys and certificates on disk: private keys 0600 from their first byte, pairs side by side.

Every write goes through ``llmgw.durable.write_atomic``: a private key must
never exist on disk, even for an instant, with a mode wider than 0600, and a
reader must never see half a file.
"""

from __future__ import annotations

import os
from pathlib import Path

from llmgw.durable import PRIVATE_MODE, PUBLIC_MODE, write_atomic

__all__ = ["PRIVATE_MODE", "PUBLIC_MODE", "write_atomic", "write_private", "write_public", "pair_paths",
           "write_pair", "private_mode_problem"]


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
