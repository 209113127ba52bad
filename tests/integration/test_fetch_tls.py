"""The weights fetcher over HTTPS: a real TLS server on 127.0.0.1 with a certificate from a CA made here.

HTTPS bodies never take the fetcher's raw-socket path (that one is for plain
HTTP with a Content-Length); they are read through aiohttp's TLS transport,
with aiohttp's per-read timeout as the stall detector.  These tests drive
that path: a verified download, a resume after the fetcher was killed, and a
stall retried from where it stopped and then given up on.

The fetcher trusts what the system trust store holds (aiohttp's default
context, loaded when aiohttp is imported).  An internal CA is added the way an
operator adds one to the agent: ``SSL_CERT_FILE`` in its environment.  So each
fetch here runs as its own process (what an agent is), started with that
variable, and reports its progress messages and its result as JSON lines.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from dataclasses import asdict
from pathlib import Path

import pytest

from llmgw.agent.fetch import naming, target_path
from llmgw.settings import FetchPolicy

from fleet import until
from fetch_support import WeightsServer, tls_server_context

pytestmark = pytest.mark.integration

MIB = 1 << 20
FAST = FetchPolicy(stall_timeout=0.5, attempts=3, backoff_initial=0.05, backoff_max=0.2, connect_timeout=5,
                   progress_interval=0.05, checkpoint_bytes=1 << 20)

DRIVER = textwrap.dedent("""
    import asyncio, json, sys
    from llmgw.agent.fetch import FetchError, fetch_weights
    from llmgw.catalog import Model
    from llmgw.settings import FetchPolicy
    url, model_dir, digest, policy = sys.argv[1:5]
    def out(**kw):
        print(json.dumps(kw), flush=True)
    m = Model(name="m", source=url, served_name="m", sha256=digest or None)
    try:
        path = asyncio.run(fetch_weights(m, model_dir, progress=lambda msg: out(progress=msg), shard_id="s/r0",
                                         node_id="n1", policy=FetchPolicy(**json.loads(policy))))
    except FetchError as e:
        out(error=str(e))
    else:
        out(path=path)
""")


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    """(server SSL context, CA bundle to trust)."""
    return tls_server_context(tmp_path_factory.mktemp("weights-pki"))


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def env_trusting(ca: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SSL_CERT_FILE", "SSL_CERT_DIR")}
    if ca is not None:
        env["SSL_CERT_FILE"] = str(ca)
    return env


def start(url: str, model_dir: Path, ca: Path | None, digest: str = "", policy: FetchPolicy = FAST) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", DRIVER, url, str(model_dir), digest, json.dumps(asdict(policy))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env_trusting(ca))


def fetch(url: str, model_dir: Path, ca: Path | None, digest: str = "", policy: FetchPolicy = FAST) -> dict:
    """Run one fetch to the end: {"path" or "error": ..., "progress": [messages]}."""
    proc = start(url, model_dir, ca, digest, policy)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, (out, err)
    lines = [json.loads(x) for x in out.decode().splitlines() if x.strip()]
    result = lines[-1]
    result["progress"] = [x["progress"] for x in lines[:-1]]
    return result


def ours(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if naming.is_scratch(n))


def test_https_download_is_verified_by_sha256_and_an_unknown_ca_is_refused(tmp_path, tls):
    ctx, ca = tls
    data = random.Random(21).randbytes(3 * MIB + 17)
    with WeightsServer(ctx) as srv:
        srv.add("o/model.safetensors", data)
        url = srv.url("o/model.safetensors")
        assert url.startswith("https://")
        final = target_path(url, tmp_path)

        refused = fetch(url, tmp_path, ca=None, digest=sha(data), policy=FetchPolicy(attempts=1, connect_timeout=5))
        assert "certificate verify failed" in refused["error"], refused
        assert srv.files["o/model.safetensors"].gets == 0  # no request went out over an untrusted connection
        assert not final.exists() and os.listdir(final.parent) == []

        done = fetch(url, tmp_path, ca=ca, digest=sha(data))
        assert done.get("path") == str(final), done
        assert final.read_bytes() == data
        assert srv.files["o/model.safetensors"].gets == 1
        assert sorted(os.listdir(final.parent)) == sorted([final.name, naming.verified_name(final.name)])
        assert done["progress"] and done["progress"][-1]["bytes_total"] == len(data)

        wrong = fetch(srv.url("o/model.safetensors"), tmp_path / "other", ca=ca, digest=sha(data + b"x"))
        assert f"sha256 mismatch: expected {sha(data + b'x')}, got {sha(data)}" in wrong["error"]
        other = target_path(url, tmp_path / "other")
        assert not other.exists() and os.listdir(other.parent) == []


def test_https_resume_after_the_fetcher_is_killed_sends_range_and_if_range(tmp_path, tls):
    ctx, ca = tls
    size = 4 * MIB
    data = random.Random(22).randbytes(size)
    point = MIB + 12_345  # not on a read or chunk boundary
    with WeightsServer(ctx) as srv:
        served = srv.add("k/model.safetensors", data)
        url = srv.url("k/model.safetensors")
        final = target_path(url, tmp_path)
        box: list[subprocess.Popen] = []

        def partial_bytes() -> int:
            if not final.parent.exists():
                return 0
            return max([os.path.getsize(final.parent / n) for n in os.listdir(final.parent)
                        if n.endswith(naming.PART_SUFFIX)] or [0])

        def kill() -> None:  # the server has sent exactly ``point`` bytes and holds the rest
            until(lambda: partial_bytes() >= point, f"{point} bytes in the partial file")
            box[0].send_signal(signal.SIGKILL)
            box[0].wait()

        served.pause_at, served.on_pause = point, kill
        proc = start(url, tmp_path, ca, sha(data))
        box.append(proc)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == -signal.SIGKILL, (out, err)
        assert not final.exists() and partial_bytes() == point

        done = fetch(url, tmp_path, ca, sha(data))  # the next agent: claims the dead one's partial
        assert done.get("path") == str(final), done
        assert final.read_bytes() == data
        assert served.gets == 2
        assert served.requests[1]["Range"] == f"bytes={point - 1}-"
        assert served.requests[1]["If-Range"] == served.current_etag()
        until(lambda: served.answers[-1].finished, "the resumed answer's handler to end")  # its last count
        assert served.sent == size + 1  # resumed (one byte of overlap), not downloaded again
        assert ours(final.parent) == [naming.verified_name(final.name)]


def test_https_stall_is_retried_from_where_it_stopped_then_fails_with_a_readable_reason(tmp_path, tls):
    ctx, ca = tls
    data = random.Random(23).randbytes(3 * MIB)
    with WeightsServer(ctx) as srv:
        s = srv.add("s/model.safetensors", data, stall_after=MIB, stall_times=1)
        done = fetch(srv.url("s/model.safetensors"), tmp_path, ca, sha(data))
        assert done.get("path"), done
        assert Path(done["path"]).read_bytes() == data
        assert s.gets == 2 and s.requests[1]["Range"] == f"bytes={MIB - 1}-"
        until(lambda: s.answers[-1].finished, "the resumed answer's handler to end")  # its last count
        assert s.sent == len(data) + 1  # resumed, not restarted
        notes = [m["note"] for m in done["progress"] if m.get("note")]
        assert any(n.startswith("stalled: no bytes for 0.5s at 1.0 MiB of 3.0 MiB") and "retry 1 of 2" in n
                   for n in notes), notes

        h = srv.add("h/model.safetensors", data, stall_after=MIB)  # hung for good
        failed = fetch(srv.url("h/model.safetensors"), tmp_path, ca)
        assert failed.get("error") == ("stalled: no bytes for 0.5s at 1.0 MiB of 3.0 MiB; "
                                       "gave up after 3 attempt(s) without progress"), failed
        assert h.gets == 3 and all(r["Range"] == f"bytes={MIB - 1}-" for r in h.requests[1:])
        final = target_path(srv.url("h/model.safetensors"), tmp_path)
        assert not final.exists()
