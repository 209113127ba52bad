"""Model repositories on a plain http(s) mirror: the manifest, its checks, and what to fetch.

A Hugging Face model is a directory (safetensors shards, config, tokenizer),
not one file.  An operator mirrors it on any web server as a directory and
puts ``llmgw-manifest.json`` beside the files: every file with its size and
sha256 (``schemas/repository.schema.json``).  A model source that is an
http(s) URL ending in ``/`` names such a directory.

The manifest is what makes the directory fetchable without a listing API:
the agent knows every file, its length (the control plane sums them for the
placement memory check before anything is placed) and the digest it must
have, so a corrupted or truncated shard is refused before an engine sees it.

Pure functions only; the agent's I/O is ``llmgw.agent.fetch.repository``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

from llmgw.config import ConfigError, schema_errors

MANIFEST_NAME = "llmgw-manifest.json"
FORMAT = "llmgw-repository/1"
MAX_MANIFEST_BYTES = 32 << 20  # 100,000 files of long names fit; a runaway response does not


def is_repository_url(source: str) -> bool:
    """An http(s) URL naming a directory (it ends in ``/``), not a file."""
    parts = urlsplit(source)
    return parts.scheme in ("http", "https") and parts.path.endswith("/")


def repository_url_problem(source: str) -> str | None:
    """Why an http(s) source ending in ``/`` cannot be a repository mirror, or None."""
    parts = urlsplit(source)
    if not parts.hostname:
        return f"{source!r} names no host"
    if parts.query or parts.fragment:
        return (f"{source!r}: a repository URL may not carry a query or fragment (file URLs are "
                f"built by appending each manifest path to it)")
    if any(s in (".", "..") for s in parts.path.split("/")):
        return f"{source!r}: path has '.' or '..' segments"
    return None


HUB_PREFIX = "hf://"
DEFAULT_HUB_ENDPOINT = "https://huggingface.co"
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")
_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,254}$")


@dataclass(frozen=True)
class HubSource:
    """``hf://ORG/NAME@REVISION``: a repository on a Hugging Face compatible hub (or a mirror of one)."""

    repo_id: str
    revision: str  # branch, tag or commit; a 40-hex commit pins it


def parse_hub_source(source: str) -> HubSource:
    """The repository and revision of an ``hf://`` source; ValueError saying what is wrong."""
    if not source.startswith(HUB_PREFIX):
        raise ValueError(f"{source!r} does not start with {HUB_PREFIX}")
    rest = source[len(HUB_PREFIX):]
    repo_id, at, revision = rest.partition("@")
    if not at:
        revision = "main"
    if not _REPO_ID.match(repo_id) or ".." in repo_id:
        raise ValueError(f"{source!r}: {repo_id!r} is not a hub repository id (ORG/NAME)")
    if not _REVISION.match(revision) or ".." in revision or revision.endswith("/"):
        raise ValueError(f"{source!r}: {revision!r} is not a revision (branch, tag or commit)")
    return HubSource(repo_id, revision)


def manifest_url(source: str) -> str:
    return source + MANIFEST_NAME


def file_url(source: str, path: str) -> str:
    return source + quote(path, safe="/")


@dataclass(frozen=True)
class RepoFile:
    path: str  # relative, '/'-separated, checked by ``parse_manifest``
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    files: tuple[RepoFile, ...]
    revision: str | None
    digest: str  # sha256 of the manifest's bytes: names the local directory, pins the revision

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


class ManifestInvalid(ValueError):
    """A manifest that fails its schema or the path rules; every error with its JSON pointer."""

    def __init__(self, where: str, errors: list[ConfigError]):
        self.where, self.errors = where, sorted(errors)
        shown = self.errors[:10]
        more = f"; and {len(self.errors) - len(shown)} more" if len(self.errors) > len(shown) else ""
        super().__init__(f"manifest {where} is invalid: " + "; ".join(map(str, shown)) + more)


HIDDEN = "has a segment starting with '.', which is reserved for the fetcher's scratch files"


def path_problem(path: str) -> str | None:
    """Why ``path`` cannot name a file under the repository directory, or None."""
    if "\\" in path or "\0" in path:
        return "may not contain '\\' or NUL"
    if path.startswith("/"):
        return "must be relative"
    segments = path.split("/")
    if any(s == "" for s in segments):
        return "has an empty segment ('//' or a trailing '/')"
    if any(s in (".", "..") for s in segments):
        return "has '.' or '..' segments"
    if any(s.startswith(".") for s in segments):
        return HIDDEN
    return None


def parse_manifest(data: bytes, where: str = MANIFEST_NAME) -> Manifest:
    """The manifest in ``data``, or ManifestInvalid naming every problem by JSON pointer."""
    digest = hashlib.sha256(data).hexdigest()
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestInvalid(where, [ConfigError("", f"larger than {MAX_MANIFEST_BYTES} bytes")])
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestInvalid(where, [ConfigError("", f"not JSON: {e}")]) from None
    errors = schema_errors(doc, "repository", limit=50)
    if errors:
        raise ManifestInvalid(where, errors)
    errors = []
    seen: dict[str, int] = {}
    for i, f in enumerate(doc["files"]):
        problem = path_problem(f["path"])
        if problem:
            errors.append(ConfigError(f"/files/{i}/path", f"{f['path']!r} {problem}"))
        elif f["path"] in seen:
            errors.append(ConfigError(f"/files/{i}/path", f"{f['path']!r} already listed at /files/{seen[f['path']]}"))
        seen.setdefault(f["path"], i)
    for path, i in seen.items():  # a file cannot also be a directory of another
        parts = path.split("/")
        for k in range(1, len(parts)):
            parent = "/".join(parts[:k])
            if parent in seen:
                errors.append(ConfigError(f"/files/{seen[parent]}/path",
                                          f"{parent!r} is a file and also a directory of /files/{i} ({path!r})"))
    if errors:
        raise ManifestInvalid(where, errors)
    files = tuple(RepoFile(f["path"], f["size"], f["sha256"]) for f in doc["files"])
    return Manifest(files=files, revision=doc.get("revision"), digest=digest)


@dataclass(frozen=True)
class Plan:
    """What a fetch still has to download, and how much is already in place."""

    fetch: tuple[RepoFile, ...]  # in manifest order
    kept: tuple[RepoFile, ...]  # complete under their name in the staging directory (verified again on use)
    kept_bytes: int


def plan(manifest: Manifest, staged: Mapping[str, int]) -> Plan:
    """Split the manifest by what the staging directory holds (path -> size of a file under its final name).

    A file under its final name in the staging directory was promoted there
    by the single-file fetcher, so it is whole; one of the wrong size is from
    another revision and is fetched again.  Kept files come first, so the
    progress line starts at what is already there.
    """
    kept = tuple(f for f in manifest.files if staged.get(f.path) == f.size)
    names = {f.path for f in kept}
    fetch = tuple(f for f in manifest.files if f.path not in names)
    return Plan(fetch=fetch, kept=kept, kept_bytes=sum(f.size for f in kept))


def build_manifest(directory: str | os.PathLike[str], revision: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """(manifest, skipped) for the files under ``directory``, for an operator making a mirror.

    Hidden files and directories (``.gitattributes``, ``.cache``) are skipped
    and listed: engines do not read them and the fetcher reserves the names.
    """
    root = Path(directory)
    files, skipped = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        for d in sorted(dirnames):
            if d.startswith("."):
                skipped.append((rel_dir / d).as_posix() + "/")
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            rel = (rel_dir / name).as_posix()
            if name.startswith(".") or name == MANIFEST_NAME and rel_dir == Path("."):
                if name != MANIFEST_NAME:
                    skipped.append(rel)
                continue
            p = Path(dirpath) / name
            h = hashlib.sha256()
            with open(p, "rb") as fh:
                while chunk := fh.read(8 << 20):
                    h.update(chunk)
            files.append({"path": rel, "size": p.stat().st_size, "sha256": h.hexdigest()})
    doc: dict[str, Any] = {"format": FORMAT}
    if revision:
        doc["revision"] = revision
    doc["files"] = files
    return doc, skipped
