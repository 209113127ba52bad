"""The weights fetcher against a real HTTP server on 127.0.0.1, real files, real processes.

Each test names the property from the issue it shows.  The server
(``fetch_support.WeightsServer``) counts every GET and every byte it
sends, so "resumed" and "one download" are measured, not assumed.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from llmgw.agent.fetch import FetchError, fetch_weights, naming, target_path
from llmgw.catalog import Model
from llmgw.ctl.fleet import progress_line
from llmgw.settings import FetchPolicy

from fleet import until
from fetch_support import DirWatcher, WeightsServer

pytestmark = pytest.mark.integration

MIB = 1 << 20
FAST = FetchPolicy(stall_timeout=0.5, attempts=3, backoff_initial=0.05, backoff_max=0.2, connect_timeout=5,
                   progress_interval=0.05, checkpoint_bytes=1 << 20)


def model(url: str, sha: str | None = None) -> Model:
    return Model(name="m", source=url, served_name="m", sha256=sha)


def fetch(url: str, model_dir: Path, sha: str | None = None, policy: FetchPolicy = FAST, node: str = "n1",
          progress=None) -> str:
    return asyncio.run(fetch_weights(model(url, sha), model_dir, progress=progress or (lambda m: None),
                                     shard_id="s/r0", node_id=node, policy=policy))


def scratch_files(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.endswith((naming.PART_SUFFIX, naming.META_SUFFIX)))


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


# The fetcher as its own process (what an agent is), so it can be SIGKILLed
# anywhere, including inside the rename.  KILL_AT: "before-rename" dies just
# before os.rename, "after-rename" between the rename and the directory fsync,
# "sidecar-rename" with the sidecar's tmp file written and not yet renamed.
DRIVER = textwrap.dedent("""
    import asyncio, os, signal, sys
    import llmgw.durable
    from llmgw.agent.fetch import durable, fetch_weights, lock
    from llmgw.catalog import Model
    from llmgw.settings import FetchPolicy
    url, model_dir, node, digest, kill_at, nolock = sys.argv[1:7]
    if nolock == "1":
        async def no_lock(path):
            return None
        lock.acquire = no_lock
    real_rename, real_fsync_dir = durable.os.rename, durable.fsync_dir
    def rename(a, b):
        if kill_at == "before-rename" and str(b).endswith(".safetensors"):
            os.kill(os.getpid(), signal.SIGKILL)
        if kill_at == "sidecar-rename" and str(b).endswith(".llmgw-meta"):
            os.kill(os.getpid(), signal.SIGKILL)
        real_rename(a, b)
    def fsync_dir(d):
        if kill_at == "after-rename":
            os.kill(os.getpid(), signal.SIGKILL)
        real_fsync_dir(d)
    durable.promote.__globals__["fsync_dir"] = fsync_dir
    class _Os:
        def __getattr__(self, name):
            return rename if name in ("rename", "replace") else getattr(os, name)
    durable.os = llmgw.durable.os = _Os()  # the weights' rename, and the sidecars' (llmgw.durable.write_atomic)
    m = Model(name="m", source=url, served_name="m", sha256=digest or None)
    pol = FetchPolicy(stall_timeout=5, attempts=2, backoff_initial=0.05, backoff_max=0.1, progress_interval=0.05,
                      checkpoint_bytes=1 << 20)
    print(asyncio.run(fetch_weights(m, model_dir, progress=lambda m: None, shard_id="s/r0", node_id=node,
                                    policy=pol)), flush=True)
""")


def driver(url: str, model_dir: Path, node: str = "n1", digest: str = "", kill_at: str = "",
           nolock: bool = False) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", DRIVER, url, str(model_dir), node, digest, kill_at,
                             "1" if nolock else "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)


# ------------------------------------------------------------------ kills

def test_killed_at_20_offsets_the_final_path_is_absent_or_correct_and_resume_costs_little(tmp_path):
    size = 4 * MIB
    data = random.Random(5).randbytes(size)
    digest = sha(data)
    rng = random.Random(20)
    points: list[int | str] = [0, size - 1, "before-rename", "after-rename"] + sorted(
        rng.randrange(1, size - 1) for _ in range(16))
    ratios = []
    with WeightsServer() as srv:
        for i, point in enumerate(points):
            name = f"t{i}/model.safetensors"
            proc_box: list[subprocess.Popen] = []
            served = srv.add(name, data)
            model_dir = tmp_path / f"m{i}"
            final = target_path(srv.url(name), model_dir)
            if isinstance(point, int):
                def kill(point: int = point, directory: Path = final.parent) -> None:
                    # The server has sent exactly ``point`` bytes and holds the rest: kill the
                    # fetcher once they are in its partial file, so the offset is the fetcher's.
                    def written() -> int:
                        return max([os.path.getsize(directory / n) for n in os.listdir(directory)
                                    if n.endswith(naming.PART_SUFFIX)] or [0])
                    until(lambda: written() >= point, f"{point} bytes in the partial file")
                    proc_box[0].send_signal(signal.SIGKILL)
                    proc_box[0].wait()
                served.pause_at, served.on_pause = point, kill
            final.parent.mkdir(parents=True)
            watcher = DirWatcher(final.parent)
            try:
                proc = driver(srv.url(name), model_dir, digest=digest,
                              kill_at=point if isinstance(point, str) else "")
                proc_box.append(proc)
                out, err = proc.communicate(timeout=60)
                assert proc.returncode == -signal.SIGKILL, (point, out, err)
                # after the kill: absent or complete, never anything in between
                if final.exists():
                    assert final.read_bytes() == data, point
                # the next agent resumes (this process; the dead one's partial is claimed)
                assert fetch(srv.url(name), model_dir, digest) == str(final)
                assert final.read_bytes() == data
                events = watcher.drain()
            finally:
                watcher.close()
            on_final = {what for what, n in events if n == final.name}
            assert on_final <= {"moved_to"}, (point, on_final)  # only ever appears by rename
            assert not scratch_files(final.parent), point
            ratios.append(served.sent / size)
    assert sum(ratios) / len(ratios) <= 1.5, list(zip(points, ratios))
    assert max(ratios) < 2.0, ratios  # no trial downloaded the file twice


# ------------------------------------------------------------- concurrency

def test_eight_fetcher_processes_with_locking_disabled_still_produce_a_correct_file(tmp_path):
    data = random.Random(8).randbytes(3 * MIB)
    with WeightsServer() as srv:
        # The first response pauses half way until a second GET has arrived, so
        # the fetchers overlap however slowly the machine starts processes.
        served = srv.add("x/model.safetensors", data, trickle=(256 << 10, 0.005), pause_at=len(data) // 2)
        url = srv.url("x/model.safetensors")
        procs = [driver(url, tmp_path, node="n1", digest="", nolock=True) for _ in range(8)]
        deadline = time.monotonic() + 60
        while served.gets < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        served.release.set()
        outs = [p.communicate(timeout=120) for p in procs]
        assert all(p.returncode == 0 for p in procs), outs
        final = target_path(url, tmp_path)
        assert {o[0].decode().strip() for o in outs} == {str(final)}
        assert final.read_bytes() == data
        assert not scratch_files(final.parent)
        assert srv.files["x/model.safetensors"].gets >= 2  # they really did race: no lock serialised them


def test_eight_fetchers_in_one_process_make_exactly_one_get_and_share_the_error(tmp_path):
    data = random.Random(1).randbytes(2 * MIB)

    async def many(url: str, sink: list) -> list:
        return await asyncio.gather(*[fetch_weights(model(url), tmp_path, progress=sink.append, shard_id=f"r/r{i}",
                                                    node_id="n1", policy=FAST) for i in range(8)],
                                    return_exceptions=True)

    with WeightsServer() as srv:
        srv.add("a/model.safetensors", data, trickle=(256 << 10, 0.01))
        sink: list = []
        paths = asyncio.run(many(srv.url("a/model.safetensors"), sink))
        assert len(set(paths)) == 1 and Path(paths[0]).read_bytes() == data
        assert srv.files["a/model.safetensors"].gets == 1
        assert any(len(m.get("shard_ids", [])) == 8 for m in sink)  # one message names every waiter
        errs = asyncio.run(many(srv.url("missing/model.safetensors"), []))
        assert [str(e) for e in errs] == ["HTTP 404 Not Found"] * 8


# --------------------------------------------------------------- integrity

def test_same_size_corrupted_content_is_detected_and_nothing_is_promoted(tmp_path):
    good = random.Random(2).randbytes(2 * MIB)
    bad = bytearray(good)
    bad[MIB] ^= 0x01
    with WeightsServer() as srv:
        srv.add("c/model.safetensors", bytes(bad))
        url = srv.url("c/model.safetensors")
        with pytest.raises(FetchError) as e:
            fetch(url, tmp_path, sha(good))
        assert f"expected {sha(good)}, got {sha(bytes(bad))}" in str(e.value)
        final = target_path(url, tmp_path)
        assert not final.exists() and not scratch_files(final.parent)


def test_a_present_file_is_used_without_a_request_and_a_wrong_one_is_replaced(tmp_path):
    data = random.Random(3).randbytes(MIB)
    with WeightsServer() as srv:
        srv.add("p/model.safetensors", data)
        url = srv.url("p/model.safetensors")
        final = target_path(url, tmp_path)
        final.parent.mkdir(parents=True)
        final.write_bytes(b"x" * MIB)  # same size, other content
        assert fetch(url, tmp_path) == str(final) and srv.files["p/model.safetensors"].gets == 0
        assert fetch(url, tmp_path, sha(data)) == str(final)  # the digest is the authority
        assert final.read_bytes() == data and srv.files["p/model.safetensors"].gets == 1
        fetch(url, tmp_path, sha(data))  # verified once: the stamp spares a re-hash and a request
        assert srv.files["p/model.safetensors"].gets == 1


# ------------------------------------------------------------- resume rules

def _interrupted(srv: WeightsServer, name: str, data: bytes, model_dir: Path, at: int, **switches) -> Path:
    """A partial of ``at`` bytes left by a fetch that gave up on a stalled server."""
    s = srv.add(name, data, stall_after=at, **switches)
    with pytest.raises(FetchError, match="stalled"):
        fetch(srv.url(name), model_dir, policy=FetchPolicy(stall_timeout=0.3, attempts=1, progress_interval=1))
    final = target_path(srv.url(name), model_dir)
    parts = [n for n in os.listdir(final.parent) if n.endswith(naming.PART_SUFFIX)]
    assert len(parts) == 1 and os.path.getsize(final.parent / parts[0]) == at
    s.stall_after, s.sent, s.gets, s.requests = None, 0, 0, []
    return final


@pytest.mark.parametrize("switch", ["ignore_range", "wrong_content_range", "always_416", "new_version"])
def test_a_server_that_cannot_continue_makes_it_start_over_never_splice(tmp_path, switch):
    v1 = random.Random(4).randbytes(2 * MIB)
    v2 = random.Random(6).randbytes(2 * MIB)
    with WeightsServer() as srv:
        final = _interrupted(srv, "r/model.safetensors", v1, tmp_path, MIB)
        s = srv.files["r/model.safetensors"]
        if switch == "new_version":
            s.data = v2  # new content, new ETag: If-Range gets the whole new body
        else:
            setattr(s, switch, True)
        expect = v2 if switch == "new_version" else v1
        assert fetch(srv.url("r/model.safetensors"), tmp_path) == str(final)
        assert final.read_bytes() == expect
        assert s.requests[0].get("Range") == f"bytes={MIB - 1}-" and s.requests[0].get("If-Range")
        assert s.sent >= len(expect)  # the whole file came again
        assert not scratch_files(final.parent)


def test_a_stall_is_retried_from_where_it_stopped_then_fails_with_a_readable_reason(tmp_path):
    data = random.Random(7).randbytes(3 * MIB)
    with WeightsServer() as srv:
        s = srv.add("s/model.safetensors", data, stall_after=MIB, stall_times=1)
        notes: list = []
        path = fetch(srv.url("s/model.safetensors"), tmp_path, progress=notes.append)
        assert Path(path).read_bytes() == data
        assert s.gets == 2 and s.requests[1]["Range"] == f"bytes={MIB - 1}-"
        until(lambda: s.answers[-1].finished, "the resumed answer's handler to end")  # its last count
        assert s.sent == len(data) + 1  # resumed, not restarted (one byte of overlap)
        assert any("stalled: no bytes for 0.5s" in m.get("note", "") and "retry 1 of 2" in m["note"] for m in notes)
        srv.add("h/model.safetensors", data, stall_after=MIB)  # hung for good
        with pytest.raises(FetchError) as e:
            fetch(srv.url("h/model.safetensors"), tmp_path)
        assert "stalled: no bytes for 0.5s at 1.0 MiB of 3.0 MiB; gave up after 3 attempt(s)" in str(e.value)


def test_a_stall_in_a_chunked_body_is_retried_from_where_it_stopped_then_fails(tmp_path):
    """No Content-Length (chunked): aiohttp's body path and its per-read timeout, not the raw-socket one."""
    data = random.Random(17).randbytes(3 * MIB)
    with WeightsServer() as srv:
        s = srv.add("cs/model.gguf", data, chunked=True, stall_after=MIB, stall_times=1)
        notes: list = []
        path = fetch(srv.url("cs/model.gguf"), tmp_path, sha(data), progress=notes.append)
        assert Path(path).read_bytes() == data
        assert any(m["bytes_total"] is None and m["bytes_done"] > 0 for m in notes)  # the body had no length
        assert s.gets == 2 and s.requests[1]["Range"] == f"bytes={MIB - 1}-" and s.requests[1]["If-Range"]
        until(lambda: s.answers[-1].finished, "the resumed answer's handler to end")  # its last count
        assert s.sent == len(data) + 1  # resumed, not restarted
        assert any(m.get("note", "").startswith("stalled: no bytes for 0.5s at 1.0 MiB (length unknown); retry 1 of 2")
                   for m in notes), [m.get("note") for m in notes]
        h = srv.add("ch/model.gguf", data, chunked=True, stall_after=MIB)  # hung for good
        with pytest.raises(FetchError) as e:
            fetch(srv.url("ch/model.gguf"), tmp_path)
        assert str(e.value) == ("stalled: no bytes for 0.5s at 1.0 MiB of 3.0 MiB; "
                                "gave up after 3 attempt(s) without progress")
        assert h.gets == 3 and all(r["Range"] == f"bytes={MIB - 1}-" for r in h.requests[1:])


def test_progress_without_content_length_says_so_far(tmp_path):
    data = random.Random(9).randbytes(2 * MIB)
    with WeightsServer() as srv:
        srv.add("n/model.gguf", data, no_length=True, trickle=(128 << 10, 0.02))
        msgs: list = []
        path = fetch(srv.url("n/model.gguf"), tmp_path, progress=msgs.append)
        assert Path(path).read_bytes() == data
        mid = [m for m in msgs if 0 < m["bytes_done"] < len(data)]
        assert mid and all(m["bytes_total"] is None for m in msgs)
        line = progress_line(mid[-1])
        assert line.startswith("downloading model.gguf  ") and " so far" in line and "%" not in line


# ------------------------------------------------------------------ space

@pytest.fixture
def tiny_fs(tmp_path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a 2 MiB tmpfs here ({res.stderr.strip()}): a real ENOSPC needs one")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_mid_download_fails_cleanly_and_removes_the_partial(tiny_fs):
    data = random.Random(10).randbytes(3 * MIB)
    with WeightsServer() as srv:
        srv.add("f/model.gguf", data, no_length=True)  # no length: the pre-check cannot know
        with pytest.raises(FetchError) as e:
            fetch(srv.url("f/model.gguf"), tiny_fs)
        assert "no space left on device" in str(e.value) and "partial file was removed" in str(e.value)
        final = target_path(srv.url("f/model.gguf"), tiny_fs)
        assert not final.exists() and os.listdir(final.parent) == []  # nothing of ours left
        srv.add("g/model.gguf", data)  # with a length: refused before a byte is written
        final = target_path(srv.url("g/model.gguf"), tiny_fs)
        final.parent.mkdir(parents=True)
        watcher = DirWatcher(final.parent)
        try:
            with pytest.raises(FetchError, match="not enough space"):
                fetch(srv.url("g/model.gguf"), tiny_fs)
            events = watcher.drain()
        finally:
            watcher.close()
        assert not final.exists() and os.listdir(final.parent) == []  # no empty partial, no sidecar, no lock
        assert any(what == "create" and n.endswith(naming.PART_SUFFIX) for what, n in events)  # there was one
        assert not any(n.endswith(naming.META_SUFFIX) or naming.parse_tmp(n) for _, n in events)  # refused first


def fill(directory: Path) -> None:
    """Take every free byte of ``directory``'s file system."""
    with open(directory / "filler", "wb", buffering=0) as f:
        block = b"\0" * (64 << 10)
        try:
            while True:
                f.write(block)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    for size in (4096, 512, 1):
        try:
            with open(directory / "filler", "ab", buffering=0) as f:
                while True:
                    f.write(b"\0" * size)
        except OSError:
            pass


def test_enospc_writing_the_sidecar_leaves_no_tmp_file_behind(tiny_fs):
    """A full disk hits the first write of a length-less download: its sidecar's tmp file."""
    data = random.Random(13).randbytes(MIB)
    with WeightsServer() as srv:
        srv.add("m/model.gguf", data, no_length=True)  # no length, no pre-check: the sidecar is written first
        final = target_path(srv.url("m/model.gguf"), tiny_fs)
        final.parent.mkdir(parents=True)
        fill(tiny_fs)
        watcher = DirWatcher(final.parent)
        try:
            with pytest.raises(FetchError) as e:
                fetch(srv.url("m/model.gguf"), tiny_fs)
            events = watcher.drain()
        finally:
            watcher.close()
        assert "no space left on device" in str(e.value) and "partial file was removed" in str(e.value)
        tmps = [n for what, n in events if what == "create" and naming.parse_tmp(n)]
        assert tmps and all(n.endswith(f"{naming.META_SUFFIX}.tmp{os.getpid()}") for n in tmps), events
        assert os.listdir(final.parent) == []


def test_a_sidecar_tmp_left_by_a_killed_fetcher_is_recognised_and_removed(tmp_path):
    data = random.Random(14).randbytes(MIB)
    with WeightsServer() as srv:
        srv.add("t/model.safetensors", data)
        url = srv.url("t/model.safetensors")
        proc = driver(url, tmp_path, kill_at="sidecar-rename")
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL, (out, err)
        final = target_path(url, tmp_path)
        left = sorted(os.listdir(final.parent))
        tmps = [n for n in left if naming.parse_tmp(n)]
        assert len(tmps) == 1 and tmps[0].endswith(f"{naming.META_SUFFIX}.tmp{proc.pid}"), left
        assert all(naming.is_scratch(n) for n in left), left  # every leftover is known to be ours
        assert fetch(url, tmp_path, sha(data)) == str(final)  # the next fetch sweeps it
        assert final.read_bytes() == data
        assert sorted(os.listdir(final.parent)) == sorted([final.name, naming.verified_name(final.name)])


def test_a_resumed_partial_that_does_not_fit_is_kept_and_continues_once_there_is_room(tiny_fs):
    data = random.Random(15).randbytes(3 * MIB // 2)
    with WeightsServer() as srv:
        final = _interrupted(srv, "k/model.gguf", data, tiny_fs, MIB // 2)  # 0.5 MiB kept of 1.5 MiB
        fill(tiny_fs)
        with pytest.raises(FetchError, match=r"not enough space in .*: 0\.5 MiB of 1\.5 MiB on disk"):
            fetch(srv.url("k/model.gguf"), tiny_fs)
        left = os.listdir(final.parent)  # the resume state, claimed by the refused fetch, untouched
        parts = [n for n in left if n.endswith(naming.PART_SUFFIX)]
        assert len(left) == 2 and len(parts) == 1 and naming.meta_name(parts[0]) in left, left
        assert os.path.getsize(final.parent / parts[0]) == MIB // 2
        os.unlink(tiny_fs / "filler")
        s = srv.files["k/model.gguf"]
        assert fetch(srv.url("k/model.gguf"), tiny_fs, sha(data)) == str(final)
        assert final.read_bytes() == data
        # Counted per answer: the refused fetch's answer may still be writing its first piece
        # into the closed connection, and a total reset under it would count that too.
        resumed = s.answers[-1]
        until(lambda: resumed.finished, "the resumed answer's handler to end")
        assert s.requests[-1]["Range"] == f"bytes={MIB // 2 - 1}-" and resumed.sent == len(data) - MIB // 2 + 1
        assert sorted(os.listdir(final.parent)) == sorted([final.name, naming.verified_name(final.name)])
