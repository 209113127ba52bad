"""Pure decisions of the weights fetcher: names on disk, what may be resumed, what a response allows."""

from __future__ import annotations

from pathlib import PurePosixPath

import pytest

from llmgw.agent.fetch import naming
from llmgw.agent.fetch.resume import (Action, Meta, Validator, judge, parse_content_range, request_headers,
                                      resume_offset)
from llmgw.weightprobe import WEIGHT_SUFFIX_GROUPS

URL = "https://weights.example:8443/org/m/model.safetensors"
ETAG = '"abc123"'
LM = "Wed, 01 Jan 2025 00:00:00 GMT"


def meta(total=1000, etag=ETAG, lm=LM, boot="boot-1", durable=0, url=URL):
    return Meta(url=url, validator=Validator(etag, lm), total=total, boot_id=boot, durable=durable)


# ------------------------------------------------------------------ naming

def test_final_path_comes_from_the_url_alone_and_keeps_the_file_name():
    assert naming.target_relpath(URL) == PurePosixPath("weights.example_8443/org/m/model.safetensors")
    signed = naming.target_relpath(URL + "?X-Amz-Signature=1")
    assert signed.name == "model.safetensors" and signed.parent.name.startswith("q-")
    assert naming.target_relpath(URL + "?X-Amz-Signature=2") != signed


@pytest.mark.parametrize("bad", ["https://h/", "https://h", "https://h/a/../b.bin", "ftp://h/x", "https://h/.hidden"])
def test_urls_that_name_no_file_or_escape_are_refused(bad):
    with pytest.raises(naming.SourceURLError):
        naming.target_relpath(bad)


def test_scratch_names_never_look_like_weights_and_carry_node_and_owner():
    owner = naming.Owner(4242, 99, "0a1b2c3d", "ff00aa")
    part = naming.partial_name("model.safetensors", "gpu-1.rack2", owner)
    assert part.startswith(".") and not part.endswith(".safetensors")
    assert not any(part.lower().endswith(sfx) for grp in WEIGHT_SUFFIX_GROUPS for sfx in grp)
    assert naming.parse_partial(part, "model.safetensors") == ("gpu-1.rack2", owner)
    assert naming.parse_partial(part, "other.safetensors") is None
    assert naming.is_scratch(part) and naming.is_scratch(naming.meta_name(part))
    assert not naming.is_scratch("model.safetensors")
    # two fetchers in one process differ by nonce, so they never share a partial
    twin = naming.Owner(4242, 99, "0a1b2c3d", "ff00ab")
    assert naming.partial_name("m", "n", twin) != naming.partial_name("m", "n", owner)


# ------------------------------------------------------------------ resume

def test_nothing_is_kept_without_a_usable_validator():
    assert resume_offset(500, None, URL, "boot-1") == 0
    assert resume_offset(500, meta(etag=None, lm=None), URL, "boot-1") == 0
    assert resume_offset(500, meta(url=URL + "x"), URL, "boot-1") == 0
    assert resume_offset(2000, meta(total=1000), URL, "boot-1") == 0  # longer than the file: not ours


def test_a_weak_etag_is_never_sent_in_if_range():
    assert Validator('W/"x"', None).if_range() is None
    assert Validator('W/"x"', LM).if_range() == LM
    assert Validator(ETAG, LM).if_range() == ETAG


def test_after_a_reboot_only_the_fsynced_prefix_is_trusted():
    assert resume_offset(800, meta(durable=300), URL, "boot-1") == 800
    assert resume_offset(800, meta(durable=300), URL, "boot-2") == 300


def test_resume_asks_from_one_byte_before_the_end_with_if_range():
    headers, start = request_headers(800, meta())
    assert start == 799 and headers["Range"] == "bytes=799-" and headers["If-Range"] == ETAG
    assert headers["Accept-Encoding"] == "identity"
    headers, start = request_headers(0, meta())
    assert start is None and "Range" not in headers and "If-Range" not in headers


def test_meta_round_trips_and_garbage_is_none():
    m = meta(durable=7)
    assert Meta.from_json(m.to_json()) == m
    assert Meta.from_json("{not json") is None and Meta.from_json("{}") is None


# ------------------------------------------------------------------ judge

def test_a_206_that_matches_is_appended():
    d = judge(206, "Partial Content", {"Content-Range": "bytes 799-999/1000", "Content-Length": "201", "ETag": ETAG},
              799, meta())
    assert d.action is Action.APPEND and d.start == 799 and d.total == 1000


@pytest.mark.parametrize("headers,why", [
    ({"Content-Range": "bytes 800-999/1000", "ETag": ETAG}, "does not start"),
    ({"Content-Range": "bytes 799-998/1000", "ETag": ETAG}, "does not run to the end"),
    ({"Content-Range": "bytes 799-999/*", "ETag": ETAG}, "does not run to the end"),
    ({"Content-Range": "bytes 799-1999/2000", "ETag": ETAG}, "length changed"),
    ({"Content-Range": "bytes 799-999/1000", "ETag": '"other"'}, "ETag changed"),
    ({"Content-Range": "bytes 799-999/1000", "Content-Length": "5", "ETag": ETAG}, "disagrees"),
    ({"Content-Range": "items 1-2/3"}, "unusable"),
    ({}, "unusable"),
])
def test_a_206_that_does_not_match_what_was_asked_starts_over(headers, why):
    d = judge(206, "Partial Content", headers, 799, meta())
    assert d.action is Action.RESTART and why in d.reason


def test_last_modified_change_restarts_when_it_was_the_validator():
    d = judge(206, "", {"Content-Range": "bytes 799-999/1000", "Last-Modified": "Thu, 02 Jan 2025 00:00:00 GMT"},
              799, meta(etag=None))
    assert d.action is Action.RESTART and "Last-Modified changed" in d.reason


def test_200_to_a_range_request_means_the_whole_new_body():
    d = judge(200, "OK", {"Content-Length": "1000", "ETag": '"new"'}, 799, meta())
    assert d.action is Action.WHOLE and d.start == 0 and d.total == 1000 and d.validator.etag == '"new"'
    assert "200" in d.reason


def test_200_without_length_has_no_total():
    assert judge(200, "OK", {}, None, None).total is None


def test_416_starts_over_and_other_statuses_split_into_retry_and_fail():
    assert judge(416, "", {}, 799, meta()).action is Action.RESTART
    assert judge(503, "Service Unavailable", {}, None, None).action is Action.RETRY
    assert judge(429, "", {}, None, None).action is Action.RETRY
    d = judge(404, "Not Found", {}, None, None)
    assert d.action is Action.FAIL and d.reason == "HTTP 404 Not Found"
    assert judge(206, "", {"Content-Range": "bytes 0-9/10"}, None, None).action is Action.RESTART


def test_content_range_parsing_rejects_impossible_ranges():
    assert parse_content_range("bytes 0-9/10") == (0, 9, 10)
    assert parse_content_range("bytes 5-4/10") is None
    assert parse_content_range("bytes 0-10/10") is None
    assert parse_content_range("bytes 0-9/*") == (0, 9, None)
