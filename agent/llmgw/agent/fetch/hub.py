"""An ``hf://ORG/NAME@REVISION`` repository, fetched with ``huggingface_hub`` before launch.

The library does the hub's protocol (revision to commit, file list, resolve
URLs, resumable ``.incomplete`` files); the agent keeps what the fetcher
promises for every source: one fetch per node (``flight``), the directory
complete or absent (staged, then renamed onto a directory named for the
commit), every file checked against the hub's digest, progress under the
replica.  The download runs in ``hubworker``, a process the agent can kill
when nobody waits for it any more.

The hub is not trusted with the file system: the worker checks every path
it lists (``hubworker``, ``confine``), the commit id must be 40 hex digits
before it names a directory or a lock, and a plain ``http://`` endpoint,
which anyone on the network path can answer for, is refused unless the
operator sets ``fetch.insecure_http_hub`` in agent.yaml.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from llmgw.agent.fetch import lock, naming
from llmgw.agent.fetch.download import FetchError, gib
from llmgw.agent.fetch.flight import Flight
from llmgw.agent.fetch.progress import RateMeter, Snapshot
from llmgw.agent.fetch.repository import publish
from llmgw.repository import DEFAULT_HUB_ENDPOINT, HubSource, parse_hub_source
from llmgw.settings import FetchPolicy

log = logging.getLogger(__name__)

# What the worker must not inherit: it goes online on purpose, and draws no progress bars.
_WORKER_ENV_DROP = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT")


def repo_root(source: str, endpoint: str | None, model_dir: str | os.PathLike[str]) -> Path:
    """``model_dir/hf/<endpoint host>/<org>/<name>``: every fetched commit of the repository lives below."""
    try:
        hub = parse_hub_source(source)
    except ValueError as e:
        raise FetchError(str(e)) from e
    parts = urlsplit(endpoint or DEFAULT_HUB_ENDPOINT)
    host = re.sub(r"[^A-Za-z0-9._-]", "_", parts.hostname or "hub") + (f"_{parts.port}" if parts.port else "")
    return Path(os.path.abspath(model_dir)) / "hf" / host / hub.repo_id


@dataclass
class Job:
    source: str
    endpoint: str | None
    model_dir: Path
    node_id: str
    policy: FetchPolicy
    flight: Flight


def endpoint_problem(endpoint: str, policy: FetchPolicy) -> str | None:
    """Why the agent will not fetch from ``endpoint``, or None."""
    scheme = urlsplit(endpoint).scheme
    if scheme == "https" or (scheme == "http" and policy.insecure_http_hub):
        return None
    if scheme == "http":
        return (f"hub endpoint {endpoint} is plain http: anyone on the network path could answer for it; "
                f"use https, or set fetch.insecure_http_hub: true in agent.yaml to allow it")
    return f"hub endpoint {endpoint!r} is not an https URL"


async def run(job: Job) -> str:
    hub = parse_hub_source(job.source)
    problem = endpoint_problem(job.endpoint or DEFAULT_HUB_ENDPOINT, job.policy)
    if problem:
        raise FetchError(problem)
    root = repo_root(job.source, job.endpoint, job.model_dir)
    if naming.COMMIT.match(hub.revision) and (root / hub.revision).is_dir():
        return str(root / hub.revision)  # pinned and present: no hub needed (restarts on an air-gapped node)
    worker = _Worker(hub, job, root)
    try:
        return await worker.run()
    finally:
        await worker.close()


class _Worker:
    def __init__(self, hub: HubSource, job: Job, root: Path):
        self.hub, self.job, self.root = hub, job, root
        self.proc: asyncio.subprocess.Process | None = None
        self.stderr = b""
        self._drain: asyncio.Task[None] | None = None

    async def run(self) -> str:
        endpoint = self.job.endpoint or DEFAULT_HUB_ENDPOINT
        self.root.mkdir(parents=True, exist_ok=True)
        args = {"repo_id": self.hub.repo_id, "revision": self.hub.revision, "endpoint": endpoint,
                "cache_dir": str(self.job.model_dir / "hf" / ".cache"), "parent": os.getpid()}
        env = {k: v for k, v in os.environ.items() if k not in _WORKER_ENV_DROP}
        env.update(HF_HUB_DISABLE_PROGRESS_BARS="1", HF_HUB_DISABLE_TELEMETRY="1",
                   HF_HOME=str(self.job.model_dir / "hf" / ".home"),
                   HF_HUB_DOWNLOAD_TIMEOUT=f"{self.job.policy.stall_timeout:g}",
                   HF_HUB_ETAG_TIMEOUT=f"{self.job.policy.connect_timeout:g}")
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "llmgw.agent.fetch.hubworker", json.dumps(args), env=env,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        self._drain = asyncio.get_running_loop().create_task(self._keep_stderr())
        resolved = await self._event("resolved")
        commit, total = resolved.get("commit"), resolved.get("total")
        if not isinstance(commit, str) or not naming.COMMIT.match(commit) or not isinstance(total, int):
            raise FetchError(f"the hub resolved {self.hub.revision!r} to {commit!r}, which is not a commit id "
                             f"(40 hex digits); nothing was fetched")
        final = self.root / commit
        async with lock.held(self.root / naming.lock_name(commit)):
            if final.is_dir():
                await self._answer("")
                return str(final)
            staging = self.root / naming.staging_name(commit, self.job.node_id)
            staging.mkdir(exist_ok=True)
            t0 = time.monotonic()
            await self._answer(str(staging))
            label = f"{self.hub.repo_id}@{self.hub.revision}"
            self.job.flight.file = f"{label} ({resolved['files']} files)"
            poller = asyncio.get_running_loop().create_task(self._progress(staging, total))
            try:
                await self._event("done")
            finally:
                poller.cancel()
            shutil.rmtree(staging / ".cache", ignore_errors=True)  # the library's resume state, done with
            publish(staging, final)
        log.info("fetched %s (commit %s, %s) to %s in %.1fs", self.job.source, commit, gib(total), final,
                 time.monotonic() - t0)
        return str(final)

    async def _answer(self, line: str) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        await self.proc.stdin.drain()

    async def _event(self, want: str) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        line = await self.proc.stdout.readline()
        try:
            ev = json.loads(line) if line else {}
        except ValueError:
            ev = {}
        if ev.get("event") == want:
            return ev
        if ev.get("event") == "error":
            raise FetchError(str(ev.get("reason")))
        await self.proc.wait()
        if self._drain is not None:
            await self._drain
        tail = self.stderr.decode(errors="replace").strip().splitlines()[-3:]
        raise FetchError(f"the hub fetch process exited ({self.proc.returncode}) before saying {want!r}"
                         + (f": {' | '.join(tail)}" if tail else ""))

    async def _keep_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        while chunk := await self.proc.stderr.read(65536):
            self.stderr = (self.stderr + chunk)[-8192:]

    async def _progress(self, staging: Path, total: int) -> None:
        """Bytes on disk in the staging tree (finished files and the library's ``.incomplete`` ones)."""
        meter = RateMeter()
        while True:
            done = min(total, await asyncio.to_thread(_bytes_under, staging))
            self.job.flight.publish(Snapshot(done, total, meter.sample(time.monotonic(), done)))
            await asyncio.sleep(self.job.policy.progress_interval or 0.5)

    async def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()
        if self._drain is not None:
            self._drain.cancel()


def _bytes_under(root: Path) -> int:
    n = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            if name.endswith((".lock", ".metadata")):
                continue
            with contextlib.suppress(OSError):
                n += os.stat(os.path.join(dirpath, name)).st_size
    return n
