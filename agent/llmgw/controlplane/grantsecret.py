"""The grant secret on disk: ``<state_dir>/grant.key``.

Grants must verify after a restart, or a restarted control plane would have
to stop every engine it finds (or believe agents on their word).  So the
secret lives in a file that survives restarts: 0600 in a 0700 directory,
created atomically on first start, never logged.

Format: one secret per line, 64 hex digits (32 bytes); blank lines and
``#`` comments are ignored.  The first secret signs new grants; every one
verifies.  To rotate: put a new line first and keep the old one below it
until every replica granted under it has been replaced, then delete it.

Without a ``state_dir`` the secret is ephemeral (``GrantKeys.fresh``): every
engine adopted after a restart then fails to verify and is replaced.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

from llmgw.controlplane.grants import GrantKeys
from llmgw.controlplane.store import GRANT_SECRET_KEY, ControlPlaneStore
from llmgw.durable import PRIVATE_MODE, write_atomic

log = logging.getLogger("llmgw.controlplane")

KEY_FILE = "grant.key"
DIR_MODE = 0o700


class GrantSecretError(Exception):
    """The secret file is unusable; the message says why and what to do."""


def parse(text: str, where: str) -> tuple[bytes, ...]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            raw = bytes.fromhex(line)
        except ValueError:
            raise GrantSecretError(f"{where}: line {n} is not hex") from None
        if len(raw) < 32:
            raise GrantSecretError(f"{where}: line {n} has {len(raw)} bytes; a grant secret needs at least 32")
        out.append(raw)
    if not out:
        raise GrantSecretError(f"{where}: no secret in the file")
    return tuple(out)


def _check_private(path: Path, st: os.stat_result, want: int, what: str) -> None:
    if st.st_mode & 0o077:
        raise GrantSecretError(f"{path}: {what} mode {stat.S_IMODE(st.st_mode):04o} lets others read it; "
                               f"chmod {want:o} {path}")
    if st.st_uid != os.geteuid():
        raise GrantSecretError(f"{path}: {what} owned by uid {st.st_uid}, not this process's {os.geteuid()}")


def load_or_create(state_dir: str | os.PathLike[str]) -> GrantKeys:
    """The grant secrets in ``state_dir``, made on first start; ``GrantSecretError`` if unusable."""
    directory = Path(state_dir)
    try:
        directory.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        _check_private(directory, directory.stat(), DIR_MODE, "directory")
    except OSError as e:
        raise GrantSecretError(f"state_dir {directory}: {e.strerror or e}") from e
    path = directory / KEY_FILE
    try:
        write_atomic(path, (secrets.token_hex(32) + "\n").encode(), mode=PRIVATE_MODE, overwrite=False)
        log.info("created the grant secret %s", path)
    except FileExistsError:
        pass  # the usual case: made by an earlier start (or a racing one, whose file wins)
    except OSError as e:
        raise GrantSecretError(f"cannot create {path}: {e.strerror or e}") from e
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise GrantSecretError(f"cannot read {path}: {e.strerror or e}") from e
    with os.fdopen(fd, "r", encoding="ascii", errors="replace") as f:
        _check_private(path, os.fstat(f.fileno()), PRIVATE_MODE, "file")
        keys = parse(f.read(), str(path))
    if len(keys) > 1:
        log.info("grant secret %s: signing with the first of %d secrets; all verify", path, len(keys))
    return GrantKeys(keys)


def grant_keys(state_dir: str | None) -> GrantKeys:
    """The secrets for ``state_dir``, or an ephemeral one (with a warning) when there is none."""
    if state_dir is None:
        log.warning("no state_dir in server.yaml: grants are signed with a secret that dies with this process; "
                    "after a restart every running engine is replaced instead of adopted")
        return GrantKeys.fresh()
    return load_or_create(state_dir)


def from_store(store: ControlPlaneStore) -> GrantKeys:
    """The grant secrets shared by several control planes through their store (``ha``), made on first need.

    Read when this process takes the lead, so every leader signs and verifies
    with the same secrets and a takeover adopts the engines the last leader
    placed.  The write is the store's, fenced on leading like every other.
    """
    raw = store.secret(GRANT_SECRET_KEY)
    if raw is None:
        store.put_secret(GRANT_SECRET_KEY, (secrets.token_hex(32) + "\n").encode())
        log.info("created the grant secret in %s", store.backend.where)
        raw = store.secret(GRANT_SECRET_KEY)
    if raw is None:
        raise GrantSecretError(f"{store.backend.where}: the grant secret just written cannot be read back")
    return GrantKeys(parse(raw.decode("ascii", "replace"), f"{store.backend.where} {GRANT_SECRET_KEY}"))
