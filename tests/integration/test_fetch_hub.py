"""hf://ORG/NAME@REVISION through huggingface_hub, against a Hugging Face compatible hub on loopback
(``hub_support.HubServer``): a real fleet read back with ``llmgw ctl``, and a real agent supervisor whose
hub fetch is stopped half-way and resumed."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from fleet import Fleet, until
from hub_support import HubServer
from llmgw.settings import FetchPolicy
from tests.support import procfs
from supervisor_harness import make_spec
from fetch_agent import Agent

pytestmark = pytest.mark.integration

KIB = 1 << 10


def hub_files(n: int, seed: int, size: int) -> dict[str, bytes]:
    r = random.Random(seed)
    files = {"config.json": b'{"architectures": ["Sim"]}', "tokenizer/tokenizer.json": r.randbytes(3 * KIB)}
    files.update({f"model-{i:05d}-of-{n - 2:05d}.safetensors": r.randbytes(size + i) for i in range(1, n - 1)})
    return files


def proc_env_argv(pid: int) -> tuple[dict[bytes, bytes], list[bytes]]:
    env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
    return env, Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")


def test_a_fleet_fetches_an_hf_repository_once_for_8_shards_from_the_named_endpoint_and_refuses_a_bad_file(tmp_path):
    files = hub_files(20, seed=7, size=64 * KIB)
    total = sum(map(len, files.values()))
    with HubServer() as hub, Fleet(tmp_path, nodes={"a": 9}, replicas=8) as f:
        repo = hub.add("org/tiny", files, revisions=("main", "v1"))
        bad_files = hub_files(4, seed=8, size=4 * KIB)
        bad = hub.add("org/bad", bad_files)
        corrupt = "model-00002-of-00002.safetensors"
        bad.serve_instead[corrupt] = bytes(len(bad_files[corrupt]))  # same size, other bytes
        f.config["models"] = [{"name": "tiny", "source": "hf://org/tiny@v1", "hub_endpoint": hub.url},
                              {"name": "bad", "source": "hf://org/bad@main", "hub_endpoint": hub.url}]
        f.config["deployments"].append({"model": "bad", "profile": "sim", "replicas": 1})
        f.write_config()
        agent_yaml = tmp_path / "a" / "agent.yaml"
        cfg = yaml.safe_load(agent_yaml.read_text())
        cfg["model_dir"] = str(tmp_path / "a" / "models")
        cfg["fetch"] = {"insecure_http_hub": True}  # the test hub is plain http on loopback
        agent_yaml.write_text(yaml.safe_dump(cfg))
        f.start()

        ready = f.wait_ready(8, extra=lambda rs: all(r["model"] == "tiny" for r in rs))
        assert len(ready) == 8
        # The control plane sized it from the hub's file list (the memory check has it).
        (tiny,) = [m for m in f.get("/v1/catalog")["models"] if m["name"] == "tiny"]
        assert tiny["weights"] == {"bytes": total, "source": "measured from URL"}
        assert repo.gets == {p: 1 for p in files}  # eight shards on one node, one GET per file
        local = tmp_path / "a" / "models" / "hf" / f"127.0.0.1_{hub.port}" / "org" / "tiny" / repo.commit
        got = {p.relative_to(local).as_posix(): p.read_bytes() for p in local.rglob("*") if p.is_file()}
        assert got == files  # complete, and nothing of the library's resume state published
        engines = 0
        for pid in f.engine_pids():
            env, argv = proc_env_argv(pid)
            if str(local).encode() in argv:
                engines += 1
                assert env.get(b"HF_HUB_OFFLINE") == b"1" and env.get(b"TRANSFORMERS_OFFLINE") == b"1"
        assert engines == 8

        reason = until(lambda: next((s.get("reason") for r in f.replicas()["replicas"] if r["model"] == "bad"
                                     for s in r["shards"] if s["state"] == "failed"), None),
                       "the corrupted file to fail its shard", on_timeout=f.dump)
        expected = hashlib.sha256(bad_files[corrupt]).hexdigest()
        actual = hashlib.sha256(bad.serve_instead[corrupt]).hexdigest()
        assert reason == (f"fetching hf://org/bad@main: {corrupt}: sha256 mismatch: expected {expected}, "
                          f"got {actual}; the file was discarded")
        assert f"{corrupt}: sha256 mismatch" in f.ctl("replicas").stdout
        assert not (tmp_path / "a" / "models" / "hf" / f"127.0.0.1_{hub.port}" / "org" / "bad" / bad.commit).exists()


def hubworkers(parent: int | None = None) -> list[int]:
    """Live hub fetch processes started by ``parent`` (this process by default)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if (b"llmgw.agent.fetch.hubworker" in cmd and procfs.state(int(entry)) not in (None, "Z")
                    and f'"parent": {parent or os.getpid()}' in cmd.decode(errors="replace")):
                out.append(int(entry))
    return out


def test_a_stopped_hub_fetch_ends_its_process_and_the_next_start_keeps_the_files_it_finished(tmp_path):
    """huggingface_hub writes each download to a file of its own process and does not resume it after a
    kill; what must hold is that the agent's fetch process ends with the shard, and files already
    finished are not downloaded again."""
    files = hub_files(10, seed=9, size=128 * KIB)
    held = "model-00004-of-00008.safetensors"  # stays in flight until the test lets it go

    async def main(hub: HubServer) -> None:
        repo = hub.repos["org/slow"]
        a = Agent(tmp_path, FetchPolicy(progress_interval=0.05, insecure_http_hub=True))
        try:
            spec = make_spec("slow.sim.0-x/r0", source="hf://org/slow@main")
            spec["model"]["hub_endpoint"] = hub.url
            a.sup.start(spec)
            await a.until(lambda: repo.gets.get(held) == 1 and any(m["bytes_done"] >= 3 * 128 * KIB
                                                                  for m in a.progress), "three files' bytes")
            assert len(hubworkers()) == 1
            await a.sup.stop("slow.sim.0-x/r0", "test")
            await a.until(lambda: not hubworkers(), "the hub fetch process to end")
            assert a.states("slow.sim.0-x/r0")[-1] == "stopped"
            staging = (tmp_path / "models" / "hf" / f"127.0.0.1_{hub.port}" / "org" / "slow"
                       / f".{repo.commit}.{a.config.node_id}.llmgw-staging")
            finished = {p.relative_to(staging).as_posix() for p in staging.rglob("*")
                        if p.is_file() and ".cache" not in p.relative_to(staging).parts}
            assert len(finished) >= 2, sorted(finished)
            for p in finished:
                assert (staging / p).read_bytes() == files[p]  # whole under its name, or not there at all

            repo.trickle = None
            repo.hold.clear()
            spec2 = make_spec("slow.sim.0-y/r0", source="hf://org/slow@main")
            spec2["model"]["hub_endpoint"] = hub.url
            a.sup.start(spec2)
            await a.until(lambda: "starting" in a.states("slow.sim.0-y/r0"), "the second start to launch")
            shard = a.sup.shards["slow.sim.0-y/r0"]
            path = Path(shard.argv[shard.argv.index("serve") + 1])
            assert {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()} == files
            for p in finished:
                assert repo.gets[p] == 1, p  # kept, not fetched again
            assert repo.gets[held] == 2  # the one in flight when the fetch was stopped: again, from its start
            env, _ = proc_env_argv(shard.identity.pid)
            assert env.get(b"HF_HUB_OFFLINE") == b"1"
        finally:
            await a.close()

    with HubServer() as hub:
        hub.add("org/slow", files, trickle=(16 * KIB, 0.02), hold={held})
        asyncio.run(main(hub))


DRIVER = textwrap.dedent("""
    import asyncio, sys
    from llmgw.agent.fetch import fetch_repository
    from llmgw.catalog import Model
    from llmgw.settings import FetchPolicy
    m = Model(name="m", source=sys.argv[1], served_name="m", hub_endpoint=sys.argv[2])
    print(asyncio.run(fetch_repository(m, sys.argv[3], progress=lambda m: None, shard_id="s/r0", node_id="n1",
                                       policy=FetchPolicy(insecure_http_hub=True))), flush=True)
""")


def test_a_sigkilled_agent_takes_its_hub_fetch_process_with_it_and_nothing_is_published(tmp_path):
    files = hub_files(4, seed=10, size=64 * KIB)
    held = "model-00001-of-00002.safetensors"
    with HubServer() as hub:
        repo = hub.add("org/k", files, hold={held})
        proc = subprocess.Popen([sys.executable, "-c", DRIVER, "hf://org/k@main", hub.url, str(tmp_path / "m")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            until(lambda: repo.gets.get(held) == 1 and hubworkers(proc.pid), "the hub fetch to be under way",
                  on_timeout=lambda: f"GETs {repo.gets}; workers {hubworkers(proc.pid)}; driver exit {proc.poll()}")
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            until(lambda: not hubworkers(proc.pid), "the fetch process to die with its agent", timeout=30)
        finally:
            proc.kill()
            proc.communicate()
        root = tmp_path / "m" / "hf" / f"127.0.0.1_{hub.port}" / "org" / "k"
        assert not (root / repo.commit).exists()  # only a staging directory, never the final one
        # a staging directory and the dead fetcher's advisory lock file (its flock went with it)
        assert {p.name for p in root.iterdir()} <= {f".{repo.commit}.n1.llmgw-staging", f".{repo.commit}.llmgw-lock"}
