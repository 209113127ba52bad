"""A hostile hf:// hub, and links planted in a staging tree, against the real fetcher: the fetch runs in its own
process (as the agent runs it, hub fetch process included) against a hub on loopback
(``hub_support.HubServer`` in its hostile modes) or a mirror (``WeightsServer``), and nothing outside
``model_dir`` may be written, published or removed; every refusal is a ``FetchError`` naming the reason."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from fleet import Fleet, until
from hub_support import HubServer
from fetch_support import mirror
from fetch_support import WeightsServer

pytestmark = pytest.mark.integration

FILES = {"config.json": b'{"architectures": ["Sim"]}', "tokenizer/tokenizer.json": b"t" * 3000,
         "model-00001-of-00001.safetensors": b"w" * 40000}

DRIVER = textwrap.dedent("""
    import asyncio, sys
    from llmgw.agent.fetch import FetchError, fetch_repository
    from llmgw.catalog import Model
    from llmgw.settings import FetchPolicy
    source, endpoint, model_dir, insecure = sys.argv[1:5]
    m = Model(name="m", source=source, served_name="m", hub_endpoint=endpoint or None)
    pol = FetchPolicy(attempts=1, insecure_http_hub=insecure == "1", progress_interval=0.05)
    try:
        print(asyncio.run(fetch_repository(m, model_dir, progress=lambda m: None, shard_id="s/r0", node_id="n1",
                                           policy=pol)), flush=True)
    except FetchError as e:
        print(f"FetchError: {e}", flush=True)
        sys.exit(3)
""")


def fetch(source: str, endpoint: str, model_dir: Path, insecure: bool = True) -> tuple[int, str]:
    res = subprocess.run([sys.executable, "-c", DRIVER, source, endpoint, str(model_dir), "1" if insecure else "0"],
                         capture_output=True, text=True, timeout=120)
    return res.returncode, res.stdout.strip() + res.stderr[-2000:]


def everything_under(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file outside model_dir that a hostile hub would like removed (its listed size differs)."""
    p = tmp_path / "victim"
    p.write_bytes(b"operator's file")
    return p


def staging_depth(tmp_path: Path, model_dir: Path, hub: HubServer) -> int:
    """How many ``..`` lead from the staging directory of org/x up to tmp_path."""
    staging = model_dir / "hf" / f"127.0.0.1_{hub.port}" / "org" / "x" / ".c.n1.llmgw-staging"
    return len(staging.relative_to(tmp_path).parts)


@pytest.mark.parametrize("kind", ["absolute", "parent"])
def test_a_hostile_path_in_the_first_listing_is_refused_and_nothing_outside_model_dir_is_removed(tmp_path, victim,
                                                                                                   kind):
    """The first listing (the one the files are checked against) names a file outside the staging directory;
    the second, if anyone asks for one, is benign.  Today's main removed the victim as 'a file that differs'."""
    model_dir = tmp_path / "m"
    with HubServer() as hub:
        hostile = str(victim) if kind == "absolute" else "../" * staging_depth(tmp_path, model_dir, hub) + "victim"
        repo = hub.add("org/x", dict(FILES))
        repo.listings = [{**FILES, hostile: b"another size than the victim's"}]
        rc, out = fetch("hf://org/x@main", hub.url, model_dir)
    assert victim.read_bytes() == b"operator's file"
    assert rc == 3, out
    assert f"the hub lists a file {hostile!r} that" in out and "nothing was fetched" in out
    assert repo.gets == {}  # refused before a single download
    assert not (model_dir / "hf" / f"127.0.0.1_{hub.port}" / "org" / "x" / repo.commit).exists()


def test_a_second_listing_that_differs_is_never_asked_for(tmp_path, victim):
    """The tree is listed once; files are fetched by name from that listing, so a hub that would answer a
    second listing with a hostile path never gets the chance."""
    model_dir = tmp_path / "m"
    with HubServer() as hub:
        hostile = "../" * staging_depth(tmp_path, model_dir, hub) + "victim"
        repo = hub.add("org/x", dict(FILES))
        repo.listings = [dict(FILES), {**FILES, hostile: b"x"}]
        rc, out = fetch("hf://org/x@main", hub.url, model_dir)
    assert rc == 0, out
    assert repo.tree_calls == 1
    final = model_dir / "hf" / f"127.0.0.1_{hub.port}" / "org" / "x" / repo.commit
    assert out.splitlines()[0] == str(final)
    assert {p: (final / p).read_bytes() for p in FILES} == FILES
    assert victim.read_bytes() == b"operator's file"


def test_hidden_files_in_a_listing_are_skipped_not_written(tmp_path):
    """``.gitattributes`` is in every hub repository; a hidden path could also be the library's own resume
    state (``.cache/huggingface/...``): neither is fetched, as ``llmgw ctl manifest`` skips them."""
    model_dir = tmp_path / "m"
    with HubServer() as hub:
        files = {**FILES, ".gitattributes": b"*.safetensors filter=lfs\n",
                 ".cache/huggingface/download/config.json.metadata": b"poison"}
        repo = hub.add("org/x", files)
        rc, out = fetch("hf://org/x@main", hub.url, model_dir)
    assert rc == 0, out
    final = Path(out.splitlines()[0])
    assert everything_under(final) == {"config.json", "tokenizer", "tokenizer/tokenizer.json",
                                       "model-00001-of-00001.safetensors"}
    assert ".gitattributes" not in repo.gets


@pytest.mark.parametrize("sha", ["/../../../chosen", "../../../chosen", "0" * 39 + "/..", "A" * 40])
def test_a_commit_id_that_is_not_40_hex_digits_is_refused_before_it_names_anything(tmp_path, sha):
    """Today's main named the final directory, the staging directory and the lock by it: ``/../../...``
    published the repository where the hub chose."""
    model_dir = tmp_path / "m"
    with HubServer() as hub:
        repo = hub.add("org/x", dict(FILES))
        repo.sha = sha.replace("chosen", str(tmp_path / "chosen").lstrip("/"), 1) if sha.startswith("/") else sha
        rc, out = fetch("hf://org/x@main", hub.url, model_dir)
    assert rc == 3, out
    assert f"to {repo.sha!r}, which is not a commit id (40 hex digits)" in out
    assert [p.name for p in tmp_path.iterdir()] == ["m"]
    assert not [p for p in everything_under(model_dir) if "llmgw" in p]  # no staging directory, no lock
    assert not (tmp_path / "chosen").exists()
    assert repo.gets == {}


def test_a_plain_http_hub_is_refused_unless_the_agent_allows_it(tmp_path):
    model_dir = tmp_path / "m"
    with HubServer() as hub:
        repo = hub.add("org/x", dict(FILES))
        rc, out = fetch("hf://org/x@main", hub.url, model_dir, insecure=False)
        assert rc == 3, out
        assert f"hub endpoint {hub.url} is plain http" in out and "fetch.insecure_http_hub: true" in out
        assert repo.api_calls == 0 and repo.gets == {}
        rc, out = fetch("hf://org/x@main", hub.url, model_dir, insecure=True)
        assert rc == 0, out


def test_a_link_out_of_a_hub_staging_directory_is_refused_and_nothing_is_written_through_it(tmp_path):
    model_dir = tmp_path / "m"
    outside = tmp_path / "outside"
    outside.mkdir()
    with HubServer() as hub:
        repo = hub.add("org/x", dict(FILES))
        staging = model_dir / "hf" / f"127.0.0.1_{hub.port}" / "org" / "x" / f".{repo.commit}.n1.llmgw-staging"
        staging.mkdir(parents=True)
        (staging / "tokenizer").symlink_to(outside)
        rc, out = fetch("hf://org/x@main", hub.url, model_dir)
    assert rc == 3, out
    assert f"{staging / 'tokenizer'} is a symlink to {outside}, outside {staging}" in out
    assert list(outside.iterdir()) == []
    assert not (staging.parent / repo.commit).exists()


def test_a_link_out_of_a_mirror_staging_directory_is_refused_and_nothing_is_written_through_it(tmp_path):
    model_dir = tmp_path / "m"
    outside = tmp_path / "outside"
    outside.mkdir()
    with WeightsServer() as srv:
        url, digest = mirror(srv, "models/x", dict(FILES))
        parent = model_dir / f"127.0.0.1_{urlsplit(url).port}" / "models" / "x"
        staging = parent / f".{digest[:16]}.n1.llmgw-staging"
        staging.mkdir(parents=True)
        (staging / "tokenizer").symlink_to(outside)
        rc, out = fetch(url, "", model_dir)
    assert rc == 3, out
    assert f"{staging / 'tokenizer'} is a symlink to {outside}, outside {staging}" in out
    assert list(outside.iterdir()) == []
    assert not (parent / digest[:16]).exists()


def test_an_agent_without_the_switch_fails_the_shard_of_a_plain_http_hub_with_the_reason(tmp_path):
    """Through a real fleet: the refusal is the shard's failure reason, read back with ``llmgw ctl``."""
    with HubServer() as hub, Fleet(tmp_path, nodes={"a": 1}, replicas=1) as f:
        repo = hub.add("org/x", dict(FILES))
        f.config["models"] = [{"name": "tiny", "source": "hf://org/x@main", "hub_endpoint": hub.url}]
        f.write_config()
        agent_yaml = tmp_path / "a" / "agent.yaml"
        cfg = yaml.safe_load(agent_yaml.read_text())
        cfg["model_dir"] = str(tmp_path / "a" / "models")
        agent_yaml.write_text(yaml.safe_dump(cfg))
        f.start()
        reason = until(lambda: next((s.get("reason") for r in f.replicas()["replicas"]
                                     for s in r["shards"] if s["state"] == "failed"), None),
                       "the http hub to fail the shard", on_timeout=f.dump)
        assert reason == (f"fetching hf://org/x@main: hub endpoint {hub.url} is plain http: anyone on the network "
                          f"path could answer for it; use https, or set fetch.insecure_http_hub: true in agent.yaml "
                          f"to allow it")
        assert repo.gets == {}
        assert not os.path.exists(tmp_path / "a" / "models" / "hf" / f"127.0.0.1_{hub.port}" / "org" / "x" / repo.commit)


def test_a_real_agent_fails_the_shard_of_a_hostile_hub_and_removes_nothing_outside_model_dir(tmp_path, victim):
    """The attack as it happened, through a real fleet whose agent allows the plain-http test hub: a listing
    that names a file outside the staging directory with another size fails the shard, and the victim stays."""
    with HubServer() as hub, Fleet(tmp_path, nodes={"a": 1}, replicas=1) as f:
        model_dir = tmp_path / "a" / "models"
        hostile = "../" * staging_depth(tmp_path, model_dir, hub) + "victim"
        repo = hub.add("org/x", dict(FILES))
        repo.listings = [{**FILES, hostile: b"another size than the victim's"}]  # the agent's first listing
        f.config["models"] = [{"name": "tiny", "source": "hf://org/x@main", "hub_endpoint": hub.url,
                               "size_bytes": 1 << 20}]  # declared: the control plane does not list the tree
        f.write_config()
        agent_yaml = tmp_path / "a" / "agent.yaml"
        cfg = yaml.safe_load(agent_yaml.read_text())
        cfg["model_dir"] = str(model_dir)
        cfg["fetch"] = {"insecure_http_hub": True}
        agent_yaml.write_text(yaml.safe_dump(cfg))
        f.start()
        reason = until(lambda: next((s.get("reason") for r in f.replicas()["replicas"]
                                     for s in r["shards"] if s["state"] == "failed"), None),
                       "the hostile listing to fail the shard", on_timeout=f.dump)
        assert victim.read_bytes() == b"operator's file"
        assert reason.startswith(f"fetching hf://org/x@main: listing org/x@main at {hub.url}: the hub lists a file "
                                 f"{hostile!r} that has '.' or '..' segments; nothing was fetched"), reason
        assert repo.gets == {}
