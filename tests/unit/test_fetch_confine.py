"""The rules that keep a fetch inside its directory: hub listings, commit ids, hub endpoints, planted links."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from llmgw.agent.fetch import confine
from llmgw.agent.fetch.download import FetchError
from llmgw.agent.fetch.hub import endpoint_problem
from llmgw.agent.fetch.hubworker import commit_problem, usable
from llmgw.settings import FetchPolicy


@dataclass
class Listed:
    path: object
    size: object = 1


@pytest.mark.parametrize("path", ["/etc/passwd", "../../victim", "a/../../b", "a//b", "a/", "a\\..\\b", "a\0b", "./a"])
def test_a_listing_with_a_path_the_manifest_rules_refuse_is_refused_whole(path):
    with pytest.raises(ValueError, match="the hub lists a file"):
        usable([Listed("config.json"), Listed(path)])


def test_hidden_files_are_skipped_and_the_rest_kept_in_order():
    keep, hidden = usable([Listed(".gitattributes"), Listed("a.json"), Listed(".cache/huggingface/x"),
                           Listed("sub/.hidden"), Listed("b/c.safetensors")])
    assert [f.path for f in keep] == ["a.json", "b/c.safetensors"]
    assert hidden == [".gitattributes", ".cache/huggingface/x", "sub/.hidden"]


@pytest.mark.parametrize("files,match", [
    ([Listed("a"), Listed("a")], "twice"),
    ([Listed("a"), Listed("a/b")], "as a file and as a directory"),
    ([Listed("a", -1)], "size -1"),
    ([Listed("a", "12")], "size '12'"),
    ([Listed(None)], "None"),
])
def test_listings_that_cannot_be_a_tree_are_refused(files, match):
    with pytest.raises(ValueError, match=match):
        usable(files)


@pytest.mark.parametrize("commit", ["/../../x", "0" * 39 + "/", "0" * 39 + "/..", "A" * 40, "0" * 41, "", None, 7])
def test_a_commit_that_is_not_40_hex_digits_is_refused(commit):
    assert "not a commit id (40 hex digits)" in commit_problem(commit, "main")


def test_a_pinned_commit_must_resolve_to_itself():
    pinned = "a" * 40
    assert commit_problem(pinned, pinned) is None
    assert commit_problem("b" * 40, "main") is None
    assert "to another one" in commit_problem("b" * 40, pinned)


def test_plain_http_hubs_need_the_switch_and_other_schemes_are_refused():
    assert endpoint_problem("https://huggingface.co", FetchPolicy()) is None
    assert "fetch.insecure_http_hub: true in agent.yaml" in endpoint_problem("http://hub:8080", FetchPolicy())
    assert endpoint_problem("http://hub:8080", FetchPolicy(insecure_http_hub=True)) is None
    assert "not an https URL" in endpoint_problem("file:///etc", FetchPolicy(insecure_http_hub=True))


def test_inside_refuses_rule_breaking_paths_and_paths_through_links_outside(tmp_path: Path):
    root = tmp_path / "staging"
    (root / "in").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (root / "out").symlink_to(tmp_path / "outside")
    (root / "loop").symlink_to(root / "in")
    assert confine.inside(root, "in/a.json") == root / "in" / "a.json"
    assert confine.inside(root, "loop/a.json") == root / "loop" / "a.json"  # a link that stays inside
    for bad in ("/etc/passwd", "../x", "in/../../x"):
        with pytest.raises(FetchError, match="nothing outside"):
            confine.inside(root, bad)
    with pytest.raises(FetchError, match="leads outside"):
        confine.inside(root, "out/a.json")


def test_check_tree_names_a_link_leading_out_at_any_depth(tmp_path: Path):
    root = tmp_path / "staging"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "ok").symlink_to(root / "a")
    confine.check_tree(root)
    (root / "a" / "b" / "weights.safetensors").symlink_to("/etc/passwd")
    with pytest.raises(FetchError, match=f"{os.path.join(root, 'a', 'b', 'weights.safetensors')} is a symlink to"):
        confine.check_tree(root)
