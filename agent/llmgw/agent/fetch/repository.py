"""A whole model repository from a plain http(s) mirror, before launch.

The source is a directory URL (``https://mirror/models/qwen/``) holding
``llmgw-manifest.json`` (``llmgw.repository``).  The order of events:

1. GET the manifest; with a declared ``sha256`` its digest must match (the
   declaration pins the revision).  Its digest names the local directory
   (``naming.repository_relpath``), so a new revision never rewrites a
   directory an engine may be reading.
2. Under the advisory lock of that directory: present means done.  The
   directory only ever appears by one rename of a complete staging tree.
3. Otherwise assemble it in this node's staging directory, one file after
   the other, each through the single-file fetcher (``download``): resumable
   with Range, verified against its sha256, promoted to its name inside the
   staging tree only when whole.  A fetcher killed half-way leaves whole
   files and at most one resumable partial; the next one keeps them.
4. Drop the per-file stamps, fsync every directory of the tree, rename it
   onto the final name, fsync the parent.

Progress is one line for the whole repository: bytes of all files, the rate
over the whole transfer, and which file of how many is on its way.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import aiohttp

from llmgw.agent.backoff import Backoff
from llmgw.agent.fetch import confine, download, durable, lock, naming
from llmgw.agent.fetch.download import FetchError, gib
from llmgw.agent.fetch.flight import Flight
from llmgw.agent.fetch.progress import RateMeter, Snapshot
from llmgw.durable import fsync_dir
from llmgw.repository import (MAX_MANIFEST_BYTES, Manifest, ManifestInvalid, RepoFile, file_url, manifest_url,
                              parse_manifest, plan)
from llmgw.settings import FetchPolicy

log = logging.getLogger(__name__)

MANIFEST_COPY = ".llmgw-manifest.json"  # the manifest the directory was built from, kept inside it


def root_path(source: str, model_dir: str | os.PathLike[str]) -> Path:
    """The directory holding every fetched revision of ``source`` (the flight key: known before the manifest)."""
    try:
        return Path(os.path.abspath(model_dir)) / naming.repository_relpath(source, "x").parent
    except naming.SourceURLError as e:
        raise FetchError(str(e)) from e


def label(source: str) -> str:
    """What the progress line calls the repository: its last path segment."""
    return source.rstrip("/").rsplit("/", 1)[-1] + "/"


@dataclass
class Job:
    source: str
    model_dir: Path
    node_id: str
    sha256: str | None  # of the manifest
    policy: FetchPolicy
    flight: Flight


async def run(job: Job) -> str:
    """Fetch the repository at ``job.source``; the local directory, complete, or FetchError."""
    if job.sha256 is not None:  # pinned: a node that has it needs no mirror (restarts while the mirror is down)
        pinned = job.model_dir / naming.repository_relpath(job.source, job.sha256)
        if pinned.is_dir():
            return str(pinned)
    where = manifest_url(job.source)
    data = await _get_manifest(where, job.policy)
    try:
        manifest = parse_manifest(data, where)
    except ManifestInvalid as e:
        raise FetchError(str(e)) from e
    if job.sha256 is not None and manifest.digest != job.sha256:
        raise FetchError(f"manifest {where} has sha256 {manifest.digest}, not the declared {job.sha256}: "
                         f"the mirror holds another revision; nothing was fetched")
    final = job.model_dir / naming.repository_relpath(job.source, manifest.digest)
    parent = final.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FetchError(f"cannot create {parent}: {e}") from e
    async with lock.held(parent / naming.lock_name(final.name)):
        if final.is_dir():
            log.info("%s is present (manifest %s); not fetching %s", final, manifest.digest[:16], job.source)
            return str(final)
        staging = parent / naming.staging_name(final.name, job.node_id)
        t0 = time.monotonic()
        await _assemble(job, manifest, data, staging)
        publish(staging, final)
    log.info("fetched %s (%d files, %s) to %s in %.1fs", job.source, len(manifest.files),
             gib(manifest.total_bytes), final, time.monotonic() - t0)
    return str(final)


async def _assemble(job: Job, manifest: Manifest, data: bytes, staging: Path) -> None:
    staging.mkdir(exist_ok=True)
    confine.check_tree(staging)  # a link planted in the tree would carry a checked path elsewhere
    todo = plan(manifest, _staged(staging))
    tally = Tally(job.flight, manifest.total_bytes, len(manifest.files), label(job.source), todo.kept_bytes)
    kept = set(todo.kept)
    for f in todo.kept + todo.fetch:
        try:
            target = confine.inside(staging, f.path, what="manifest file")
            await download.run(download.Job(url=file_url(job.source, f.path), final=target,
                                             node_id=job.node_id, sha256=f.sha256, policy=job.policy,
                                             publish=tally.on_file(f, f in kept)))
        except FetchError as e:
            raise FetchError(f"{f.path}: {e}") from e
        size = target.stat().st_size
        if size != f.size:  # the digest matched, so the manifest's size is the wrong one
            raise FetchError(f"{f.path}: {size} bytes with the declared sha256, but the manifest says {f.size}")
        tally.done(f, f in kept)
    durable.write_text(staging / MANIFEST_COPY, data.decode())
    confine.check_tree(staging)


def _staged(staging: Path) -> dict[str, int]:
    """Files under their final names in the staging tree (path -> size); scratch files excluded."""
    out: dict[str, int] = {}
    for dirpath, _dirs, files in os.walk(staging):
        for name in files:
            if naming.is_scratch(name) or name.startswith("."):
                continue
            p = Path(dirpath) / name
            try:
                out[p.relative_to(staging).as_posix()] = p.stat().st_size
            except OSError:
                pass
    return out


def publish(staging: Path, final: Path) -> None:
    """The staging tree, complete, becomes ``final`` in one rename (after everything in it is durable)."""
    dirs = []
    for dirpath, _dirs, files in os.walk(staging):
        for name in files:
            if naming.is_scratch(name):  # stamps and sidecars: no business in a published model
                durable.remove(Path(dirpath) / name)
        dirs.append(dirpath)
    for d in reversed(dirs):
        fsync_dir(Path(d))
    try:
        os.rename(staging, final)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST) and final.is_dir():
            log.info("%s was completed by another fetcher; discarding %s", final, staging)
            shutil.rmtree(staging, ignore_errors=True)
            return
        raise FetchError(f"cannot rename {staging} to {final}: {e}") from e
    fsync_dir(final.parent)


@dataclass
class Tally:
    """One progress line for many files: bytes of the whole repository, one rate across files."""

    flight: Flight
    total: int
    n_files: int
    name: str
    base: int  # bytes of the files finished, or kept from an earlier fetch
    finished: int = 0
    meter: RateMeter = field(default_factory=RateMeter)

    def on_file(self, f: RepoFile, kept: bool) -> Callable[[Snapshot], None]:
        """The ``publish`` for one file's download: its snapshots as the repository's."""
        if kept:  # counted in ``base`` already; a stamp check sends nothing worth showing
            return lambda snap: None
        index = self.finished + 1

        def publish(snap: Snapshot) -> None:
            self.flight.file = f"{self.name} (file {index} of {self.n_files}: {f.path})"
            done = self.base + min(snap.bytes_done, f.size)
            rate = self.meter.sample(time.monotonic(), done)
            self.flight.publish(Snapshot(done, self.total, rate, snap.note))

        return publish

    def done(self, f: RepoFile, kept: bool) -> None:
        self.finished += 1
        if not kept:
            self.base += f.size


async def _get_manifest(url: str, policy: FetchPolicy) -> bytes:
    """The manifest's bytes; transient failures retried like a file's, a refusal at once."""
    backoff = Backoff(policy.backoff_initial, policy.backoff_max)
    timeout = aiohttp.ClientTimeout(total=None, connect=policy.connect_timeout, sock_read=policy.stall_timeout)
    reason = ""
    for attempt in range(1, policy.attempts + 1):
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as resp:
                if resp.status == 200:
                    data = await resp.content.read(MAX_MANIFEST_BYTES + 1)
                    if len(data) > MAX_MANIFEST_BYTES:
                        raise FetchError(f"manifest {url} is larger than {MAX_MANIFEST_BYTES} bytes")
                    return data
                reason = f"GET {url}: HTTP {resp.status} {resp.reason or ''}".rstrip()
                if resp.status < 500 and resp.status not in (408, 429):
                    if resp.status == 404:
                        reason += f" (a repository mirror needs {url.rsplit('/', 1)[-1]} beside its files)"
                    raise FetchError(reason)
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
            reason = f"GET {url}: {type(e).__name__}: {e}".rstrip(": ")
        if attempt < policy.attempts:
            delay = backoff.next_delay()
            log.warning("%s; retry %d of %d in %.1fs", reason, attempt, policy.attempts - 1, delay)
            await asyncio.sleep(delay)
    raise FetchError(f"{reason}; gave up after {policy.attempts} attempt(s)")
