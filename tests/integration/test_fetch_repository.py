"""Whole model repositories from a plain http(s) mirror: a real mirror on loopback, real fetcher processes
SIGKILLed mid-transfer, and a real fleet (control plane, agent, engines) read back with ``llmgw ctl``."""

from __future__ import annotations

import hashlib
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fetch_support import mirror
from fleet import Fleet, until
from llmgw.ctl.fleet import human_bytes
from fetch_support import WeightsServer

pytestmark = pytest.mark.integration

KIB = 1 << 10


def manifest_by_cli(directory: Path, files: dict[str, bytes]) -> bytes:
    """The manifest ``llmgw ctl manifest`` writes for ``files`` laid out in ``directory``, as an operator makes it."""
    for p, d in files.items():
        (directory / p).parent.mkdir(parents=True, exist_ok=True)
        (directory / p).write_bytes(d)
    (directory / ".gitattributes").write_text("*.safetensors filter=lfs\n")  # a hub snapshot has one
    res = subprocess.run([sys.executable, "-m", "llmgw", "ctl", "manifest", str(directory), "--revision", "r1"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "skipped .gitattributes" in res.stderr
    data = (directory / "llmgw-manifest.json").read_bytes()
    assert f"sha256 {hashlib.sha256(data).hexdigest()}" in res.stdout
    return data


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
            def kill(offset: int = offset, directory: Path = (staging / name).parent, base: str = Path(name).name,
                     box: list[subprocess.Popen] = box) -> None:
                # The server has sent exactly ``offset`` bytes and holds the rest: kill the fetcher
                # once they are in its partial file, so the offset is the fetcher's.
                def written() -> int:
                    return max([os.path.getsize(directory / n) for n in os.listdir(directory)
                                if n.startswith(f".{base}.") and n.endswith(".llmgw-part")] or [0])
                until(lambda: written() >= offset, f"{offset} bytes of {name} in its partial file")
                box[0].send_signal(signal.SIGKILL)
                box[0].wait()

            served.pause_at, served.on_pause = offset, kill
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


def test_a_fleet_fetches_a_20_file_repository_once_for_8_shards_offline_and_refuses_a_corrupted_one(tmp_path):
    import yaml

    files = repo_files(20, seed=20, size=96 * KIB)
    total = sum(map(len, files.values()))
    bad_files = repo_files(4, seed=4, size=8 * KIB)
    corrupt = "model-00002-of-00002.safetensors"
    with WeightsServer() as srv, Fleet(tmp_path, nodes={"a": 9}, replicas=8) as f:
        url, _ = mirror(srv, "org/q", files, trickle=(32 * KIB, 0.02))
        paused = srv.files[f"org/q/{list(files)[10]}"]  # held half-way: the line cannot be missed
        paused.pause_at = len(paused.data) // 2
        srv.files["org/q/llmgw-manifest.json"].data = manifest_by_cli(tmp_path / "mirror", files)
        digest = hashlib.sha256(srv.files["org/q/llmgw-manifest.json"].data).hexdigest()
        bad_url, _ = mirror(srv, "org/bad", bad_files, lie={corrupt})
        f.config["models"] = [{"name": "tiny", "source": url, "sha256": digest},
                              {"name": "bad", "source": bad_url}]
        f.config["deployments"].append({"model": "bad", "profile": "sim", "replicas": 1})
        f.write_config()
        agent_yaml = tmp_path / "a" / "agent.yaml"
        cfg = yaml.safe_load(agent_yaml.read_text())
        cfg["fetch"] = {"progress_interval": 0.2, "attempts": 1}
        cfg["model_dir"] = str(tmp_path / "a" / "models")
        agent_yaml.write_text(yaml.safe_dump(cfg))
        f.start()

        # One line for the whole repository under each fetching shard: bytes, percentage, rate, ETA.
        line = re.compile(r"^ {6}downloading q/ \(file \d+ of 20: [^)]+\)  \d+(\.\d)? (KiB|MiB) / "
                          + re.escape(human_bytes(total)) + r"  \d+%  \d+(\.\d)? (KiB|MiB)/s  ETA \d+(s|m\d\ds)$", re.M)
        seen: list[str] = []

        def shown() -> bool:
            seen.append(f.ctl("replicas").stdout)
            return bool(line.search(seen[-1]))

        until(shown, "a progress line under a fetching replica",
              on_timeout=lambda: "\n".join(x for x in "".join(seen).splitlines() if "downloading" in x))
        paused.release.set()
        # The control plane knew the size from the manifest, for the memory check, before any byte arrived.
        (tiny,) = [m for m in f.get("/v1/catalog")["models"] if m["name"] == "tiny"]
        assert tiny["weights"] == {"bytes": total, "source": "measured from URL"}

        ready = f.wait_ready(8, extra=lambda rs: all(r["model"] == "tiny" for r in rs))
        assert len(ready) == 8
        for p in files:  # eight shards on one node, one GET per file
            assert srv.files[f"org/q/{p}"].gets == 1, p
        agent_gets = [h for h in srv.files["org/q/llmgw-manifest.json"].requests
                      if "aiohttp" in h.get("User-Agent", "")]  # the control plane's sizing GET is httpx
        assert len(agent_gets) == 1
        local = tmp_path / "a" / "models" / f"127.0.0.1_{srv.port}" / "org" / "q" / digest[:16]
        assert {p: got.read_bytes() for p, got in names_under(local).items() if p in files} == files
        engines = []
        for pid in f.engine_pids():
            env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if str(local).encode() in argv:
                engines.append(pid)
                assert env.get(b"HF_HUB_OFFLINE") == b"1" and env.get(b"TRANSFORMERS_OFFLINE") == b"1"
        assert len(engines) == 8

        reason = until(lambda: next((s.get("reason") for r in f.replicas()["replicas"] if r["model"] == "bad"
                                     for s in r["shards"] if s["state"] == "failed"), None),
                       "the corrupted file to fail its shard", on_timeout=f.dump)
        good = hashlib.sha256(bad_files[corrupt]).hexdigest()
        wrong = hashlib.sha256(b"not " + bad_files[corrupt]).hexdigest()
        assert f"fetching {bad_url}: {corrupt}: sha256 mismatch: expected {wrong}, got {good}" in reason
        assert f"{corrupt}: sha256 mismatch: expected {wrong}" in f.ctl("replicas").stdout
        bad_dir = tmp_path / "a" / "models" / f"127.0.0.1_{srv.port}" / "org" / "bad"
        assert [p.name for p in bad_dir.iterdir() if not p.name.startswith(".")] == []  # nothing published


def test_a_repository_fetch_longer_than_start_timeout_still_launches_and_the_clock_starts_at_launch(tmp_path):
    """start_timeout is the engine's: a fetch of 3 s under a 1.5 s start_timeout launches, and the engine
    (which never answers) is failed 1.5 s after the fetch ended and it was launched, not after the start."""
    import asyncio

    from llmgw.settings import FetchPolicy
    from supervisor_harness import make_spec
    from fetch_agent import Agent

    files = repo_files(6, seed=6, size=64 * KIB)
    start_timeout = 1.5

    async def main(srv: WeightsServer, url: str) -> None:
        a = Agent(tmp_path, FetchPolicy(progress_interval=0.1))
        try:
            sid = "slow.sim.0-x/r0"
            a.sup.start(make_spec(sid, source=url, timeout=start_timeout))
            await a.until(lambda: "failed" in a.states(sid), "the start timeout after launch")
            at = {what: t for t, what in a.order}
            assert a.states(sid) == ["pending", "fetching", "starting", "failed"]
            assert at["starting"] - at["fetching"] > start_timeout  # the fetch alone outlasted start_timeout
            fetched = max(t for t, what in a.order if what == "progress" and t < at["starting"])
            assert at["failed"] - fetched >= start_timeout  # counted from the end of the fetch (the launch)
            assert a.status[-1]["reason"].startswith(f"not ready within start_timeout ({start_timeout:g}s)")
        finally:
            await a.close()

    with WeightsServer() as srv:
        url, _ = mirror(srv, "org/slow", files, trickle=(16 * KIB, 0.12))  # ~4 writes of 0.12 s per file: ~3 s
        asyncio.run(main(srv, url))
