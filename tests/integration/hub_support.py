"""A Hugging Face compatible hub for the hf:// tests (this module holds no tests).

A real HTTP server (aiohttp on 127.0.0.1, in a thread with its own loop)
answering the requests ``huggingface_hub`` makes for ``snapshot_download``,
as read from the library's source (``hf_api.py``, ``file_download.py``):

* ``GET /api/models/{repo}/revision/{rev}``: the revision resolved to a
  commit (``sha``) with its ``siblings``;
* ``GET /api/models/{repo}/tree/{commit}?recursive=...``: every file with
  ``size``, ``oid`` (git blob id) and, for LFS files, ``lfs.oid`` (sha256);
* ``HEAD``/``GET /{repo}/resolve/{commit}/{path}``: ``X-Repo-Commit``,
  ``ETag`` (the blob id) or ``X-Linked-Etag`` + ``X-Linked-Size`` (the
  sha256 and size of an LFS file), ``Range`` answered with 206.

Every GET of a file is counted, so a test can tell one download from eight.

Hostile modes, for the tests that the agent keeps a hub inside ``model_dir``:
``sha`` answers the revision with any string in place of the commit, and
``listings`` makes the n-th tree listing list other paths (sizes and bytes
of its own) than the files served.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from dataclasses import dataclass, field

from aiohttp import web


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


@dataclass
class HubRepo:
    commit: str
    files: dict[str, bytes]
    lfs: set[str]  # paths stored in LFS (listed with their sha256)
    revisions: tuple[str, ...] = ("main",)
    serve_instead: dict[str, bytes] = field(default_factory=dict)  # path -> bytes sent in place of the listed ones
    gets: dict[str, int] = field(default_factory=dict)
    ranges: list[tuple[str, str]] = field(default_factory=list)  # (path, Range header) of every ranged GET
    api_calls: int = 0
    trickle: tuple[int, float] | None = None
    hold: set[str] = field(default_factory=set)  # paths whose GET stops after its first write (at most half)
    sha: str | None = None  # what the revision endpoint says the commit is (hostile: anything)
    listings: list[dict[str, bytes]] = field(default_factory=list)  # the n-th tree listing, then ``files``
    tree_calls: int = 0


class HubServer:
    def __init__(self) -> None:
        self.repos: dict[str, HubRepo] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self.port = 0

    def add(self, repo_id: str, files: dict[str, bytes], *, lfs_suffix: str = ".safetensors",
            **kw) -> HubRepo:
        commit = hashlib.sha1(repo_id.encode() + b"".join(sorted(files.values()))).hexdigest()
        repo = HubRepo(commit=commit, files=files, lfs={p for p in files if p.endswith(lfs_suffix)}, **kw)
        self.repos[repo_id] = repo
        return repo

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "HubServer":
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), name="hub", daemon=True)
        self._thread.start()
        if not self._started.wait(30):
            raise RuntimeError("hub server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.loop is not None and self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(30)

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        app = web.Application()
        app.router.add_get("/api/models/{org}/{name}/revision/{rev}", self._revision)
        app.router.add_get("/api/models/{org}/{name}/tree/{rev:.+}", self._tree)
        app.router.add_get("/{org}/{name}/resolve/{rev}/{path:.+}", self._resolve)  # HEAD too
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._started.set()
        await self._stop.wait()
        await runner.cleanup()

    def _repo(self, request: web.Request) -> tuple[str, HubRepo]:
        repo_id = f"{request.match_info['org']}/{request.match_info['name']}"
        repo = self.repos.get(repo_id)
        if repo is None:
            raise web.HTTPNotFound(headers={"X-Error-Code": "RepoNotFound"}, text='{"error": "Repository not found"}')
        return repo_id, repo

    def _commit(self, repo: HubRepo, rev: str) -> str:
        if rev in (repo.commit, repo.sha) or rev in repo.revisions:
            return repo.sha or repo.commit
        raise web.HTTPNotFound(headers={"X-Error-Code": "RevisionNotFound"}, text='{"error": "Invalid rev id"}')

    async def _revision(self, request: web.Request) -> web.Response:
        repo_id, repo = self._repo(request)
        repo.api_calls += 1
        commit = self._commit(repo, request.match_info["rev"])
        return web.json_response({"id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                                  "siblings": [{"rfilename": p} for p in repo.files]})

    async def _tree(self, request: web.Request) -> web.Response:
        _, repo = self._repo(request)
        repo.api_calls += 1
        self._commit(repo, request.match_info["rev"])
        listed = repo.listings[repo.tree_calls] if repo.tree_calls < len(repo.listings) else repo.files
        repo.tree_calls += 1
        out, dirs = [], set()
        for p, data in listed.items():
            parts = p.split("/")
            for k in range(1, len(parts)):
                dirs.add("/".join(parts[:k]))
            entry = {"type": "file", "oid": git_blob_id(data), "size": len(data), "path": p}
            if p in repo.lfs:
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            out.append(entry)
        out += [{"type": "directory", "oid": "0" * 40, "size": 0, "path": d} for d in sorted(dirs)]
        return web.json_response(out)

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        _, repo = self._repo(request)
        commit = self._commit(repo, request.match_info["rev"])
        path = request.match_info["path"]
        if path not in repo.files:
            raise web.HTTPNotFound(headers={"X-Error-Code": "EntryNotFound"})
        listed = repo.files[path]
        data = repo.serve_instead.get(path, listed)
        headers = {"X-Repo-Commit": commit, "Accept-Ranges": "bytes"}
        if path in repo.lfs:
            headers["X-Linked-Etag"] = f'"{hashlib.sha256(listed).hexdigest()}"'
            headers["X-Linked-Size"] = str(len(listed))
            headers["ETag"] = f'"{hashlib.sha256(listed).hexdigest()}"'
        else:
            headers["ETag"] = f'"{git_blob_id(listed)}"'
        if request.method == "HEAD":
            return web.Response(headers={**headers, "Content-Length": str(len(data))})
        repo.gets[path] = repo.gets.get(path, 0) + 1
        start, status = 0, 200
        rng = request.headers.get("Range")
        if rng:
            repo.ranges.append((path, rng))
            start = int(rng.removeprefix("bytes=").split("-")[0])
            if start >= len(data):
                return web.Response(status=416, headers={"Content-Range": f"bytes */{len(data)}"})
            status = 206
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        resp = web.StreamResponse(status=status, headers=headers)
        resp.content_length = len(data) - start
        await resp.prepare(request)
        step, pause = repo.trickle or (1 << 20, 0.0)
        if path in repo.hold:
            step = min(step, max(1, (len(data) - start) // 2))  # held before the body is complete
        pos = start
        while pos < len(data):
            await resp.write(data[pos:pos + step])
            pos += step
            while path in repo.hold:
                await asyncio.sleep(0.05)
            if pause:
                await asyncio.sleep(pause)
        await resp.write_eof()
        return resp
