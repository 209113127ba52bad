"""Whole model repositories from a plain http(s) mirror: a real mirror on loopback, real fetcher processes
SIGKILLed mid-transfer, and a real fleet (control plane, agent, engines) read back with ``llmgw ctl``."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fleet import Fleet, until
from test_fetch_support import WeightsServer

pytestmark = pytest.mark.integration

KIB = 1 << 10


def mirror(srv: WeightsServer, prefix: str, files: dict[str, bytes], *, lie: set[str] = frozenset(),
           **switches) -> tuple[str, str]:
    """Serve ``files`` under ``prefix/`` with their manifest; (source URL, manifest sha256).

    A path in ``lie`` is listed with the digest of other bytes: the mirror serves a corrupted file.
    """
    listed = [{"path": p, "size": len(d),
               "sha256": hashlib.sha256(d if p not in lie else b"not " + d).hexdigest()} for p, d in files.items()]
    data = json.dumps({"format": "llmgw-repository/1", "revision": "test", "files": listed}).encode()
    for p, d in files.items():
        srv.add(f"{prefix}/{p}", d, **switches)
    srv.add(f"{prefix}/llmgw-manifest.json", data)
    return srv.url(f"{prefix}/"), hashlib.sha256(data).hexdigest()


def repo_files(n: int, seed: int, size: int) -> dict[str, bytes]:
    r = random.Random(seed)
    files = {"config.json": b'{"architectures": ["Sim"]}', "tokenizer/tokenizer.json": r.randbytes(3 * KIB)}
    files.update({f"model-{i:05d}-of-{n - 2:05d}.safetensors": r.randbytes(size + i) for i in range(1, n - 1)})
    return files


def names_under(root: Path) -> dict[str, Path]:
    return {p.relative_to(root).as_posix(): p for p in root.rglob("*") if p.is_file()}


# The fetcher as its own process, as an agent runs it, so that it can be SIGKILLed anywhere.
DRIVER = textwrap.dedent("""
    import asyncio, sys
    from llmgw.agent.fetch import fetch_repository
    from llmgw.catalog import Model
    from llmgw.settings import FetchPolicy
    url, model_dir, digest = sys.argv[1:4]
    m = Model(name="m", source=url, served_name="m", sha256=digest)
    pol = FetchPolicy(stall_timeout=5, attempts=2, backoff_initial=0.05, backoff_max=0.1, progress_interval=0.05,
                      checkpoint_bytes=64 << 10)
    print(asyncio.run(fetch_repository(m, model_dir, progress=lambda m: None, shard_id="s/r0", node_id="n1",
                                       policy=pol)), flush=True)
""")


def driver(url: str, model_dir: Path, digest: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", DRIVER, url, str(model_dir), digest],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_killed_at_random_offsets_no_partial_file_is_ever_under_a_final_name_and_the_fetch_resumes(tmp_path):
    files = repo_files(8, seed=21, size=512 * KIB)
    models = tmp_path / "models"
    rng = random.Random(2121)
    paths = list(files)
    with WeightsServer() as srv:
        url, digest = mirror(srv, "org/q", files, chunk=16 * KIB)
        final_parent = models / f"127.0.0.1_{srv.port}" / "org" / "q"
        final = final_parent / digest[:16]
        staging = final_parent / f".{digest[:16]}.n1.llmgw-staging"
        points = sorted(rng.sample(range(2, len(paths)), 4))  # a growing prefix of the files each time
        for k in points:
            name = paths[k]
            offset = rng.randrange(1, len(files[name]))
            box: list[subprocess.Popen] = []
            served = srv.files[f"org/q/{name}"]
            served.pause_at, served.on_pause = offset, lambda: box[0].send_signal(signal.SIGKILL)
            served.release.clear()
            box.append(driver(url, models, digest))
            out, err = box[0].communicate(timeout=60)
            served.release.set()
            assert box[0].returncode == -signal.SIGKILL, (name, offset, out, err)
            # Nothing under the final directory's name, and in the staging tree every file under its
            # own name is whole; the interrupted one is only a hidden, resumable partial.
            assert not final.exists()
            staged = {p: f for p, f in names_under(staging).items() if not Path(p).name.startswith(".")}
            for p, f in staged.items():
                assert f.read_bytes() == files[p], p
            assert name not in staged
            assert any(Path(p).name.startswith(f".{Path(name).name}.n1.") for p in names_under(staging)), \
                sorted(names_under(staging))
        gets_before = {p: srv.files[f"org/q/{p}"].gets for p in paths}
        proc = driver(url, models, digest)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert out.decode().strip() == str(final)
        assert not staging.exists()
        got = names_under(final)
        assert set(got) == set(files) | {".llmgw-manifest.json"}  # no sidecar, stamp or partial published
        for p, data in files.items():
            assert got[p].read_bytes() == data, p
        # Resumed, not restarted: files finished before a kill were not fetched again, and the last
        # interrupted one continued with a Range request.
        last = paths[points[-1]]
        for p in paths[:points[-1]]:
            assert srv.files[f"org/q/{p}"].gets == gets_before[p], p
        assert srv.files[f"org/q/{last}"].requests[-1].get("Range", "").startswith("bytes=")
        sent = sum(s.sent for s in srv.files.values())
        assert sent < sum(map(len, files.values())) + 4 * 600 * KIB  # at most what was in flight at each kill
        # Once present (and pinned by its digest) it is used without asking the mirror at all.
        before = sum(s.gets for s in srv.files.values())
        proc = driver(url, models, digest)
        assert proc.communicate(timeout=60)[0].decode().strip() == str(final)
        assert sum(s.gets for s in srv.files.values()) == before
