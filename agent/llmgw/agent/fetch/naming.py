"""Where a fetched source lands, and the names used while it is on its way.

Pure functions only.  Three rules drive every name here:

* The final path is derived from the URL alone (host, then the URL's path),
  so every node and every agent restart computes the same place, and an
  operator can tell from a directory listing which URL a file came from.
* A download in progress never carries the final name, nor anything a scan
  for weights could take for it: scratch files start with a dot and end in
  ``.llmgw-part`` / ``.llmgw-meta``, which no weights suffix matches.  A
  partial file under the model's name would be found by the next scan,
  reported present, and handed to an engine that fails on it.
* Scratch names carry the node id and a per-fetch owner token, so two nodes
  sharing a directory (NFS, Lustre) never write one file, and a fetcher can
  tell a partial left by a dead process (resumable) from one a live process
  is still writing (not to be touched).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from urllib.parse import unquote, urlsplit

PART_SUFFIX = ".llmgw-part"
META_SUFFIX = ".llmgw-meta"
LOCK_SUFFIX = ".llmgw-lock"
VERIFIED_SUFFIX = ".llmgw-verified"
STAGING_SUFFIX = ".llmgw-staging"
# ``durable.write_text``'s tmp file for a sidecar or a stamp: ``<name>.tmp<pid>``.
_TMP = re.compile(r"^(?P<of>\..+(?:\.llmgw-meta|\.llmgw-verified))\.tmp(?P<pid>\d+)$")

_SAFE = re.compile(r"[^A-Za-z0-9._-]")
# A hub commit id: the only thing from a hub that names a directory (and its lock and staging tree).
COMMIT = re.compile(r"^[0-9a-f]{40}$")


class SourceURLError(ValueError):
    """The URL cannot name a file under model_dir (no file name, ``..`` segments, ...)."""


def _clean(segment: str) -> str:
    return _SAFE.sub("_", segment)


def target_relpath(url: str) -> PurePosixPath:
    """``https://host:8443/org/m/model.safetensors?sig=..`` -> ``host_8443/org/m/q-<hash>/model.safetensors``.

    A query string (signed URLs) becomes its own directory level, hashed, so
    two signatures of one object do not overwrite each other's weights while
    the file name stays the one the engine expects.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SourceURLError(f"not an http(s) URL: {url!r}")
    segments = [unquote(s) for s in parts.path.split("/") if s != ""]
    if not segments or parts.path.endswith("/"):
        raise SourceURLError(f"URL names no file (it ends in '/' or has no path): {url!r}")
    if any(s in (".", "..") for s in segments):
        raise SourceURLError(f"URL path has '.' or '..' segments: {url!r}")
    host = _clean(parts.hostname) + (f"_{parts.port}" if parts.port else "")
    dirs = [_clean(s) for s in segments[:-1]]
    if parts.query:
        dirs.append("q-" + hashlib.sha256(parts.query.encode()).hexdigest()[:12])
    name = _clean(segments[-1])
    if name.startswith("."):
        raise SourceURLError(f"URL file name starts with '.', which is reserved for scratch files: {url!r}")
    return PurePosixPath(host, *dirs, name)


def repository_relpath(url: str, digest: str) -> PurePosixPath:
    """``https://mirror/models/qwen/`` + manifest digest -> ``mirror/models/qwen/<digest[:16]>``.

    The manifest's digest is the last level: a new revision on the mirror
    gets a directory of its own instead of being rewritten under an engine
    that may be reading the old one, and a directory of that name can only
    hold that manifest's files.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or not parts.path.endswith("/"):
        raise SourceURLError(f"not an http(s) directory URL: {url!r}")
    if parts.query:
        raise SourceURLError(f"repository URL has a query string: {url!r}")
    segments = [unquote(s) for s in parts.path.split("/") if s != ""]
    if any(s in (".", "..") for s in segments):
        raise SourceURLError(f"URL path has '.' or '..' segments: {url!r}")
    host = _clean(parts.hostname) + (f"_{parts.port}" if parts.port else "")
    return PurePosixPath(host, *[_clean(s) for s in segments], digest[:16])


def staging_name(final_name: str, node_id: str) -> str:
    """The directory a repository is assembled in before it is renamed to ``final_name``.

    Per node, not per process: a fetcher killed half-way leaves its files
    (each whole under its name, or a resumable partial) for the next one on
    the node; two nodes sharing the directory never write one staging tree.
    """
    return f".{final_name}.{node_id}{STAGING_SUFFIX}"


@dataclass(frozen=True)
class Owner:
    """Who writes a partial file: a process (pid + start time + boot) and a per-fetch nonce.

    The nonce keeps two fetchers inside one process apart; liveness is judged
    on the process part only.
    """

    pid: int
    start_time: int
    boot: str  # first 8 hex digits of the boot id
    nonce: str

    def token(self) -> str:
        return f"{self.pid}-{self.start_time}-{self.boot}-{self.nonce}"

    @classmethod
    def parse(cls, token: str) -> "Owner | None":
        bits = token.split("-")
        if len(bits) != 4 or not bits[0].isdigit() or not bits[1].isdigit():
            return None
        return cls(int(bits[0]), int(bits[1]), bits[2], bits[3])


def partial_name(file_name: str, node_id: str, owner: Owner) -> str:
    return f".{file_name}.{node_id}.{owner.token()}{PART_SUFFIX}"


def meta_name(partial: str) -> str:
    """The sidecar holding a partial's validator and length (see ``resume.Meta``)."""
    return partial[: -len(PART_SUFFIX)] + META_SUFFIX


def lock_name(file_name: str) -> str:
    return f".{file_name}{LOCK_SUFFIX}"


def verified_name(file_name: str) -> str:
    return f".{file_name}{VERIFIED_SUFFIX}"


def tmp_name(name: str, pid: int) -> str:
    """Where ``durable.write_text`` writes ``name`` before renaming it into place."""
    return f"{name}.tmp{pid}"


def parse_tmp(name: str) -> tuple[str, int] | None:
    """(the sidecar or stamp it was to become, writer pid) of a tmp file of ours, or None."""
    m = _TMP.match(name)
    return (m.group("of"), int(m.group("pid"))) if m else None


def parse_partial(name: str, file_name: str) -> tuple[str, Owner] | None:
    """(node id, owner) of a scratch file for ``file_name``, or None if it is not one."""
    prefix = f".{file_name}."
    if not (name.startswith(prefix) and name.endswith(PART_SUFFIX)):
        return None
    middle = name[len(prefix): -len(PART_SUFFIX)]
    node_id, sep, token = middle.rpartition(".")
    owner = Owner.parse(token) if sep else None
    if not node_id or owner is None:
        return None
    return node_id, owner


def is_scratch(name: str) -> bool:
    """Whether a directory entry is one of the fetcher's own files (never weights)."""
    if name.startswith(".") and name.endswith((PART_SUFFIX, META_SUFFIX, LOCK_SUFFIX, VERIFIED_SUFFIX,
                                                STAGING_SUFFIX)):
        return True
    return parse_tmp(name) is not None
