"""One hf:// repository through ``huggingface_hub``, in a process of its own (``python -m``).

The library's download is blocking and cannot be interrupted from the
outside once it runs in a thread; a shard that is stopped, or an agent that
exits, must be able to end it.  So it runs here, and the agent kills this
process when nobody waits for the fetch any more: the library keeps its
``.incomplete`` files and resumes them with Range next time.

Protocol, one JSON object per line on stdout:

1. ``{"event": "resolved", "commit": SHA, "total": BYTES, "files": N}``
   once the revision is resolved and the file list read (the agent names
   the directory by the commit, which must be 40 hex digits);
2. the agent answers on stdin with the staging directory, or an empty line
   when it already has that commit;
3. ``{"event": "done"}`` once every file is there and matches the hub's
   digest (sha256 for LFS files, the git blob id for the others: the
   library itself checks sizes only), or ``{"event": "error", "reason": ...}``.

The hub is not trusted: the tree is listed once, here, every path in it
must pass the manifest rules (``confine``), and each file is then fetched by
name from that one listing (``hf_hub_download``), never by
``snapshot_download``, which lists the tree a second time: a hub answering
the two listings differently would get a path past the check.  Hidden files
(``.gitattributes``) are skipped, as ``llmgw ctl manifest`` skips them: the
fetcher reserves dot names and engines do not read them.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from llmgw.agent.fetch import confine
from llmgw.agent.fetch.naming import COMMIT
from llmgw.agent.fetch.download import FetchError
from llmgw.repository import HIDDEN, path_problem


def _say(**event: Any) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def git_blob_id(path: Path) -> str:
    """The id git gives a file's content: sha1 of ``blob <size>\\0`` and the bytes."""
    h = hashlib.sha1(f"blob {path.stat().st_size}\0".encode(), usedforsecurity=False)
    _feed(h, path)
    return h.hexdigest()


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    _feed(h, path)
    return h.hexdigest()


def _feed(h: Any, path: Path) -> None:
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)


def usable(files: list[Any]) -> tuple[list[Any], list[str]]:
    """(files to fetch, hidden paths skipped) of a hub's listing; ValueError for a path the rules refuse."""
    keep, hidden, seen = [], [], set()
    for f in files:
        path = f.path
        if not isinstance(path, str):
            raise ValueError(f"the hub lists a file whose path is {path!r}")
        problem = path_problem(path)
        if problem == HIDDEN:
            hidden.append(path)
            continue
        if problem:
            raise ValueError(f"the hub lists a file {path!r} that {problem}")
        if path in seen:
            raise ValueError(f"the hub lists {path!r} twice")
        if not isinstance(f.size, int) or isinstance(f.size, bool) or f.size < 0:
            raise ValueError(f"the hub lists {path!r} with size {f.size!r}")
        seen.add(path)
        keep.append(f)
    for path in seen:  # a file cannot also be a directory of another
        parts = path.split("/")
        for k in range(1, len(parts)):
            if "/".join(parts[:k]) in seen:
                raise ValueError(f"the hub lists {'/'.join(parts[:k])!r} as a file and as a directory of {path!r}")
    return keep, hidden


def commit_problem(commit: Any, revision: str) -> str | None:
    """Why the commit the hub resolved ``revision`` to cannot name a directory, or None."""
    if not isinstance(commit, str) or not COMMIT.match(commit):
        return f"the hub resolved {revision!r} to {commit!r}, which is not a commit id (40 hex digits)"
    if COMMIT.match(revision) and commit != revision:
        return f"the hub resolved commit {revision} to another one, {commit}"
    return None


def verify(staging: Path, files: list[Any]) -> str | None:
    """Why the downloaded files are not the hub's, or None.  A file that differs is removed."""
    for f in files:
        try:
            p = confine.inside(staging, f.path, what="hub file")
        except FetchError as e:
            return str(e)
        if p.is_symlink() or not p.is_file():
            return f"{f.path}: missing after the download"
        if p.stat().st_size != f.size:
            got = p.stat().st_size
            p.unlink()
            return f"{f.path}: {got} bytes, the hub lists {f.size}; the file was discarded"
        if f.lfs is not None:
            expected, actual, what = f.lfs.sha256, sha256(p), "sha256"
        else:
            expected, actual, what = f.blob_id, git_blob_id(p), "git blob id"
        if actual != expected:
            p.unlink()
            return f"{f.path}: {what} mismatch: expected {expected}, got {actual}; the file was discarded"
    return None


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when the agent that started it dies (SIGKILL included): an orphan would
    go on downloading for nobody, beside the next agent's own fetch of the same files."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the request took effect
        os._exit(1)


def main(argv: list[str]) -> int:
    job = json.loads(argv[1])
    if job.get("parent"):
        die_with_parent(int(job["parent"]))
    try:
        from huggingface_hub import HfApi, hf_hub_download
        from huggingface_hub.hf_api import RepoFile
    except ImportError as e:
        _say(event="error", reason=f"huggingface_hub is not installed ({e}); hf:// sources need it")
        return 1
    where = f"{job['repo_id']}@{job['revision']} at {job['endpoint']}"
    try:
        api = HfApi(endpoint=job["endpoint"])
        commit = api.model_info(job["repo_id"], revision=job["revision"]).sha
        problem = commit_problem(commit, job["revision"])
        if problem:
            _say(event="error", reason=f"resolving {where}: {problem}; nothing was fetched")
            return 1
        listed = [f for f in api.list_repo_tree(job["repo_id"], recursive=True, revision=commit)
                  if isinstance(f, RepoFile)]
    except Exception as e:  # the library's errors name the URL and the status
        _say(event="error", reason=f"resolving {where}: {type(e).__name__}: {e}")
        return 1
    try:
        files, hidden = usable(listed)
    except ValueError as e:
        _say(event="error", reason=f"listing {where}: {e}; nothing was fetched")
        return 1
    _say(event="resolved", commit=commit, total=sum(f.size for f in files), files=len(files), hidden=len(hidden))
    staging = sys.stdin.readline().strip()
    if not staging:
        return 0
    root = Path(staging)
    try:
        confine.check_tree(root)
        for f in files:
            confine.inside(root, f.path, what="hub file")
    except FetchError as e:
        _say(event="error", reason=str(e))
        return 1

    def one(f: Any) -> None:
        hf_hub_download(job["repo_id"], f.path, revision=commit, local_dir=staging, cache_dir=job["cache_dir"],
                        endpoint=job["endpoint"])

    try:
        with ThreadPoolExecutor(max_workers=job.get("max_workers", 4)) as pool:
            for _ in pool.map(one, files):
                pass
        confine.check_tree(root)
    except FetchError as e:
        _say(event="error", reason=str(e))
        return 1
    except Exception as e:
        _say(event="error", reason=f"downloading {job['repo_id']}@{commit}: {type(e).__name__}: {e}")
        return 1
    problem = verify(root, files)
    if problem:
        _say(event="error", reason=problem)
        return 1
    _say(event="done")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    sys.exit(main(sys.argv))
