"""The load generator's token-by-token check of a simulator stream (benchmarks/router/loadgen.py)."""

import importlib.util
import json
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location(
    "loadgen", Path(__file__).resolve().parents[2] / "benchmarks" / "router" / "loadgen.py")
loadgen = importlib.util.module_from_spec(spec)
spec.loader.exec_module(loadgen)


def stream(pieces, done=True, error=None):
    events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    events += [{"choices": [{"index": 0, "delta": {"content": p}}]} for p in pieces]
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    if error:
        body += b"data: " + json.dumps({"error": {"message": error}}).encode() + b"\n\n"
    return body + (b"data: [DONE]\n\n" if done else b"")


def toks(n, start=0):
    return [f"tok{i}" if i == 0 else f" tok{i}" for i in range(start, n)]


def test_a_whole_stream_passes():
    assert loadgen.check_stream(stream(toks(4)), 4) is None


@pytest.mark.parametrize("body, kind", [
    (stream(toks(2) + toks(4, 3)), "integrity"),  # tok2 missing
    (stream(toks(3) + [" tok2", " tok3"]), "integrity"),  # tok2 twice
    (stream(toks(4), done=False), "integrity"),  # no [DONE]
    (stream(toks(3)), "integrity"),  # short without an error
    (stream(toks(2), error="upstream died"), "cut_midstream"),  # the client was told
    (stream(toks(1) + [" tok5"], error="x"), "integrity"),  # an error after a wrong prefix
    (stream(toks(4)) + b"data: {}\n\n", "integrity"),  # data after [DONE]
])
def test_every_way_a_stream_can_be_wrong_is_named(body, kind):
    got = loadgen.check_stream(body, 4)
    assert got is not None and got[0] == kind, got
