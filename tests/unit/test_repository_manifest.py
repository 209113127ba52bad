"""The repository manifest (parsing, every error by JSON pointer), its URLs and the plan of what to fetch."""

from __future__ import annotations

import hashlib
import json

import pytest

from llmgw.agent.fetch.naming import SourceURLError, is_scratch, repository_relpath, staging_name
from llmgw.catalog import SourceKind, source_kind
from llmgw.repository import (HubSource, ManifestInvalid, RepoFile, build_manifest, file_url, manifest_url,
                              parse_hub_source, parse_manifest, plan, repository_url_problem)

SHA = "a" * 64


def doc(*files, **extra) -> bytes:
    return json.dumps({"format": "llmgw-repository/1", **extra,
                       "files": [{"path": p, "size": n, "sha256": SHA} for p, n in files]}).encode()


def errors(data: bytes) -> list[tuple[str, str]]:
    with pytest.raises(ManifestInvalid) as e:
        parse_manifest(data, "https://m/q/llmgw-manifest.json")
    assert str(e.value).startswith("manifest https://m/q/llmgw-manifest.json is invalid: ")
    return [(x.pointer, x.message) for x in e.value.errors]


def test_a_valid_manifest_gives_files_total_and_its_own_digest():
    data = doc(("config.json", 10), ("model-00001-of-00002.safetensors", 1000), ("tok/vocab.json", 5),
               revision="abc123")
    m = parse_manifest(data)
    assert [f.path for f in m.files] == ["config.json", "model-00001-of-00002.safetensors", "tok/vocab.json"]
    assert m.total_bytes == 1015 and m.revision == "abc123"
    assert m.digest == hashlib.sha256(data).hexdigest()


def test_schema_errors_name_the_offending_key():
    data = json.dumps({"format": "llmgw-repository/2", "extra": 1, "files": [
        {"path": "a", "size": -1, "sha256": SHA}, {"path": "b", "size": 1, "sha256": "XYZ"}, {"path": "c"}]}).encode()
    got = errors(data)
    assert {p for p, _ in got} == {"/format", "/extra", "/files/0/size", "/files/1/sha256", "/files/2"}
    assert {m for p, m in got if p == "/files/2"} == {"'size' is a required property",
                                                     "'sha256' is a required property"}


@pytest.mark.parametrize("path, why", [
    ("/etc/passwd", "must be relative"),
    ("a/../../x", "'.' or '..'"),
    ("./a", "'.' or '..'"),
    ("a//b", "empty segment"),
    ("dir/", "empty segment"),
    (".gitattributes", "reserved for the fetcher's scratch"),
    ("a/.x.llmgw-part", "reserved for the fetcher's scratch"),
    ("a\\b", "may not contain"),
])
def test_unsafe_paths_are_refused_at_their_pointer(path, why):
    ((pointer, message),) = errors(doc(("ok.json", 1), (path, 1)))
    assert pointer == "/files/1/path" and why in message and repr(path) in message


def test_duplicates_and_a_file_that_is_also_a_directory_are_refused():
    got = errors(doc(("a", 1), ("b", 1), ("a", 2), ("b/c", 3)))
    assert ("/files/2/path", "'a' already listed at /files/0") in got
    assert ("/files/1/path", "'b' is a file and also a directory of /files/3 ('b/c')") in got


def test_not_json_and_empty_lists_are_refused_at_the_root_or_key():
    assert errors(b"{nope")[0][0] == ""
    assert errors(doc())[0][0] == "/files"


def test_urls_and_source_kind():
    src = "https://mirror:8443/models/Qwen2.5-7B/"
    assert source_kind(src) is SourceKind.REPO
    assert source_kind("https://mirror/models/q/model.gguf") is SourceKind.URL
    assert source_kind("./models/q/") is SourceKind.PATH
    assert manifest_url(src) == src + "llmgw-manifest.json"
    assert file_url(src, "sub dir/model #1.safetensors") == src + "sub%20dir/model%20%231.safetensors"
    assert repository_url_problem(src) is None
    assert "query" in repository_url_problem(src + "?sig=1")
    assert "'..'" in repository_url_problem("https://m/a/../b/")


def test_local_directory_is_named_for_the_manifest_digest_and_staging_is_scratch():
    rel = repository_relpath("https://mirror:8443/models/Qwen2.5-7B/", "0123456789abcdef" * 4)
    assert rel.as_posix() == "mirror_8443/models/Qwen2.5-7B/0123456789abcdef"
    name = staging_name(rel.name, "node-1")
    assert name.startswith(".") and is_scratch(name)
    with pytest.raises(SourceURLError):
        repository_relpath("https://mirror/models/q/?x=1", SHA)


def test_plan_keeps_whole_files_first_and_fetches_the_rest():
    m = parse_manifest(doc(("config.json", 10), ("a.safetensors", 100), ("b.safetensors", 200), ("tok.json", 5)))
    p = plan(m, {"a.safetensors": 100, "b.safetensors": 150, "stray.bin": 7})
    assert [f.path for f in p.kept] == ["a.safetensors"]
    assert [f.path for f in p.fetch] == ["config.json", "b.safetensors", "tok.json"]  # b: wrong size, fetched again
    assert p.kept_bytes == 100
    assert plan(m, {}).fetch == m.files and plan(m, {}).kept_bytes == 0
    assert RepoFile("config.json", 10, SHA) in plan(m, {}).fetch


def test_build_manifest_lists_files_skips_hidden_ones_and_parses_back(tmp_path):
    (tmp_path / "tok").mkdir()
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tok" / "vocab.json").write_text("{\"a\": 1}")
    (tmp_path / ".gitattributes").write_text("*")
    (tmp_path / ".cache").mkdir()
    (tmp_path / "llmgw-manifest.json").write_text("old")
    manifest, skipped = build_manifest(tmp_path, revision="r1")
    assert skipped == [".cache/", ".gitattributes"]
    m = parse_manifest(json.dumps(manifest).encode())
    assert [(f.path, f.size) for f in m.files] == [("config.json", 2), ("tok/vocab.json", 8)]
    assert m.files[0].sha256 == hashlib.sha256(b"{}").hexdigest() and m.revision == "r1"


@pytest.mark.parametrize("source, repo_id, revision", [
    ("hf://Qwen/Qwen2.5-7B-Instruct@a09a35458c702b33eeacc393d103063234e8bc28", "Qwen/Qwen2.5-7B-Instruct",
     "a09a35458c702b33eeacc393d103063234e8bc28"),
    ("hf://org/name@v1.0", "org/name", "v1.0"),
    ("hf://gpt2", "gpt2", "main"),
    ("hf://org/name@refs/pr/1", "org/name", "refs/pr/1"),
])
def test_hub_sources_parse(source, repo_id, revision):
    assert parse_hub_source(source) == HubSource(repo_id, revision)
    assert source_kind(source) is SourceKind.HF


@pytest.mark.parametrize("source", ["hf://", "hf://a/b/c@main", "hf://org/../x@main", "hf://org/n@", "hf://org/n@../x",
                                    "hf://-org/n@main"])
def test_bad_hub_sources_are_refused(source):
    with pytest.raises(ValueError):
        parse_hub_source(source)


def test_config_errors_for_repository_sources_point_at_the_key():
    from llmgw.config import ConfigInvalid
    from llmgw.settings import parse_server_settings

    doc = {"api": {"listen": {"port": 1}}, "insecure_no_tls": True,
           "models": [{"name": "a", "source": "https://m/q/?sig=1"},
                      {"name": "b", "source": "hf://org/../x@main"},
                      {"name": "c", "source": "hf://org/c@main", "sha256": SHA},
                      {"name": "d", "source": "https://m/d/", "hub_endpoint": "https://hub.example"},
                      {"name": "f", "source": "hf://org/f@main", "hub_endpoint": "http://127.0.0.1:9/"},
                      {"name": "g", "source": "https://m/g/", "sha256": SHA}],
           "profiles": [{"name": "p", "engine": "vllm"}], "deployments": []}
    with pytest.raises(ConfigInvalid) as e:
        parse_server_settings(doc)
    assert [x.pointer for x in e.value.errors] == ["/models/0/source", "/models/1/source", "/models/2/sha256",
                                                   "/models/3/hub_endpoint"]
    doc["models"] = [{"name": "e", "source": "hf://org/e@main", "hub_endpoint": "ftp://x"}]
    with pytest.raises(ConfigInvalid) as e:
        parse_server_settings(doc)
    assert [x.pointer for x in e.value.errors] == ["/models/0/hub_endpoint"]
