"""Decode vLLM's KV-cache events (``--kv-events-config``) from their ZMQ frames.

vLLM publishes each batch of events as three ZMQ frames: the topic, the batch's sequence
number (8 bytes, big-endian) and a msgpack payload (``vllm/distributed/kv_events.py``).
The replay socket (a ROUTER) answers a DEALER's ``[b"", start_seq]`` with one message per
buffered batch from ``start_seq`` on (``[b"", topic, seq, payload]`` in 0.32, ``[b"", seq,
payload]`` in 0.13), then an end marker: ``seq = -1`` and an empty payload.

The payload's encoding changed under consumers once already: vLLM up to 0.2x encoded every
event as a positional array led by its tag, ``["BlockStored", block_hashes, parent, ...]``;
later releases (vLLM PR #42892, June 2026: 0.26 and 0.32 were seen) encode each event as a
map tagged by ``"type"``, and newer sources drop the positional form of the outer batch too.
Decoders that assumed one form silently lost every event after an upgrade, so this one
accepts both forms at both levels, ignores map keys it does not know (new optional fields),
keeps an event type it does not know as :class:`UnknownEvent` rather than failing the batch,
and reads positional arrays in the field order below, which
``tests/unit/test_kvevents_drift.py`` checks against the pinned vLLM source.

Bad input raises :class:`KVEventDecodeError` (a ``ValueError``) naming where it is wrong,
e.g. ``events[1].block_hashes[0]: expected an int or bytes, got str``; no other exception
escapes, so one malformed batch costs its caller that batch and nothing else.

The encoder (:func:`encode_batch`, :func:`encode_message`, :func:`encode_replay`) writes what the
current vLLM writes, for the engine simulator: events as maps tagged by ``"type"`` whose fields
with a default are left out while they hold it (msgspec's ``omit_defaults``), inside the
positional batch ``[ts, events, data_parallel_rank]``; ``positional=True`` writes 0.13's arrays.

Pure logic: no sockets here; the subscriber hands over the frames it received.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

# Field order of each event as vLLM declares it (the positional encoding follows it); a
# release may end the list early (0.13 stops at "medium"), never reorder it.
BLOCK_STORED_FIELDS = (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
    "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality", "ownership",
    "session_id", "lookahead_token_ids",
)
BLOCK_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")
ALL_BLOCKS_CLEARED_FIELDS: tuple[str, ...] = ()
BATCH_FIELDS = ("ts", "events", "data_parallel_rank")
TAG_KEY = "type"  # msgspec's tag field for ``tag=True``; the tag value is the class name

# Fields vLLM declares without a default: always on the wire, even when None (the rest are left
# out while None, msgspec's omit_defaults).
_NO_DEFAULT = {"BlockStored": 7, "BlockRemoved": 2, "AllBlocksCleared": 0}

# Fields a batch or event cannot do without; the rest default to None (older releases lack them).
_REQUIRED = {
    "BlockStored": 4,  # block_hashes, parent_block_hash, token_ids, block_size
    "BlockRemoved": 1,  # block_hashes
    "AllBlocksCleared": 0,
}
END_SEQ = -1  # the replay socket's end-of-replay marker
_SEQ_BYTES = 8

BlockHash = int | bytes  # 64-bit ints by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES), digests otherwise


class KVEventDecodeError(ValueError):
    """A frame, batch or event that is not vLLM's KV-event format; the message says where."""


@dataclass(frozen=True)
class BlockStored:
    """Blocks newly full in the engine's cache, each chained to the one before it."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks evicted from the engine's cache."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    """The engine dropped its whole cache (a reset): forget every block it published."""


@dataclass(frozen=True)
class UnknownEvent:
    """An event type this decoder does not know, kept so the rest of its batch is not lost."""

    tag: str
    raw: Any


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared | UnknownEvent


@dataclass(frozen=True)
class EventBatch:
    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


@dataclass(frozen=True)
class Message:
    """One published (or replayed) batch: its topic (empty on replay), sequence number and events."""

    topic: str
    seq: int
    batch: EventBatch


# ------------------------------------------------------------------------ field checks

def _name(v: Any) -> str:
    return "None" if v is None else type(v).__name__


def _int(v: Any, where: str, *, optional: bool = False) -> int | None:
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise KVEventDecodeError(f"{where}: expected an int{' or None' if optional else ''}, got {_name(v)}")
    return v


def _str(v: Any, where: str) -> str | None:
    if v is not None and not isinstance(v, str):
        raise KVEventDecodeError(f"{where}: expected a string or None, got {_name(v)}")
    return v


def _hash(v: Any, where: str, *, optional: bool = False) -> BlockHash | None:
    if v is None and optional:
        return None
    if isinstance(v, bytes) or (isinstance(v, int) and not isinstance(v, bool)):
        return v
    raise KVEventDecodeError(f"{where}: expected an int or bytes{' or None' if optional else ''}, got {_name(v)}")


def _list(v: Any, where: str) -> list:
    if not isinstance(v, list):
        raise KVEventDecodeError(f"{where}: expected an array, got {_name(v)}")
    return v


def _hashes(v: Any, where: str) -> tuple[BlockHash, ...]:
    items = _list(v, where)
    if not items:
        raise KVEventDecodeError(f"{where}: no block hashes")
    return tuple(_hash(h, f"{where}[{i}]") for i, h in enumerate(items))


def _ints(v: Any, where: str) -> tuple[int, ...]:
    return tuple(_int(t, f"{where}[{i}]") for i, t in enumerate(_list(v, where)))


def _freeze(v: Any) -> Any:
    return tuple(_freeze(x) for x in v) if isinstance(v, list) else v


# ------------------------------------------------------------------------ events

def _fields(tag: str, raw: Any, names: tuple[str, ...], where: str) -> dict[str, Any]:
    """The event's fields by name, from either encoding; missing optional ones left out."""
    if isinstance(raw, dict):
        values = {k: v for k, v in raw.items() if k in names}
        present = [n for n in names[:_REQUIRED[tag]] if n not in values]
        if present:
            raise KVEventDecodeError(f"{where}: {tag} has no {', '.join(present)}")
        return values
    values_list = raw[1:]  # raw[0] is the tag
    if len(values_list) < _REQUIRED[tag]:
        raise KVEventDecodeError(f"{where}: {tag} has {len(values_list)} fields, needs at least {_REQUIRED[tag]} "
                                 f"({', '.join(names[:_REQUIRED[tag]])})")
    return dict(zip(names, values_list))  # extra trailing fields: a newer release's, ignored


def _block_stored(f: dict[str, Any], w: str) -> BlockStored:
    extra = f.get("extra_keys")
    lookahead = f.get("lookahead_token_ids")
    block_size = _int(f["block_size"], f"{w}.block_size")
    if block_size <= 0:
        raise KVEventDecodeError(f"{w}.block_size: must be positive, got {block_size}")
    return BlockStored(
        block_hashes=_hashes(f["block_hashes"], f"{w}.block_hashes"),
        parent_block_hash=_hash(f["parent_block_hash"], f"{w}.parent_block_hash", optional=True),
        token_ids=_ints(f["token_ids"], f"{w}.token_ids"),
        block_size=block_size,
        lora_id=_int(f.get("lora_id"), f"{w}.lora_id", optional=True),
        medium=_str(f.get("medium"), f"{w}.medium"),
        lora_name=_str(f.get("lora_name"), f"{w}.lora_name"),
        extra_keys=None if extra is None else _freeze(_list(extra, f"{w}.extra_keys")),
        group_idx=_int(f.get("group_idx"), f"{w}.group_idx", optional=True),
        kv_cache_spec_kind=_str(f.get("kv_cache_spec_kind"), f"{w}.kv_cache_spec_kind"),
        kv_cache_spec_sliding_window=_int(f.get("kv_cache_spec_sliding_window"),
                                          f"{w}.kv_cache_spec_sliding_window", optional=True),
        locality=_str(f.get("locality"), f"{w}.locality"),
        ownership=_str(f.get("ownership"), f"{w}.ownership"),
        session_id=_str(f.get("session_id"), f"{w}.session_id"),
        lookahead_token_ids=None if lookahead is None else tuple(
            _ints(x, f"{w}.lookahead_token_ids[{i}]")
            for i, x in enumerate(_list(lookahead, f"{w}.lookahead_token_ids"))),
    )


def _block_removed(f: dict[str, Any], w: str) -> BlockRemoved:
    return BlockRemoved(
        block_hashes=_hashes(f["block_hashes"], f"{w}.block_hashes"),
        medium=_str(f.get("medium"), f"{w}.medium"),
        group_idx=_int(f.get("group_idx"), f"{w}.group_idx", optional=True),
        locality=_str(f.get("locality"), f"{w}.locality"),
        ownership=_str(f.get("ownership"), f"{w}.ownership"),
    )


_EVENTS = {
    "BlockStored": (BLOCK_STORED_FIELDS, _block_stored),
    "BlockRemoved": (BLOCK_REMOVED_FIELDS, _block_removed),
    "AllBlocksCleared": (ALL_BLOCKS_CLEARED_FIELDS, lambda f, w: AllBlocksCleared()),
}


def decode_event(raw: Any, where: str = "event") -> KVEvent:
    """One event, positional (``[tag, field, ...]``) or a map tagged by ``"type"``."""
    if isinstance(raw, dict):
        tag = raw.get(TAG_KEY)
        if tag is None:
            raise KVEventDecodeError(f"{where}: a map without the {TAG_KEY!r} tag")
    elif isinstance(raw, list):
        if not raw:
            raise KVEventDecodeError(f"{where}: an empty array (no event tag)")
        tag = raw[0]
    else:
        raise KVEventDecodeError(f"{where}: expected an array or a map, got {_name(raw)}")
    if not isinstance(tag, str):
        raise KVEventDecodeError(f"{where}: the event tag must be a string, got {_name(tag)}")
    if tag not in _EVENTS:
        return UnknownEvent(tag, _freeze(raw) if isinstance(raw, list) else raw)
    names, build = _EVENTS[tag]
    return build(_fields(tag, raw, names, where), where)


def decode_batch(payload: bytes) -> EventBatch:
    """A msgpack batch: ``[ts, events, dp_rank?]`` or ``{"ts", "events", "data_parallel_rank"?}``."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise KVEventDecodeError(f"payload: expected bytes, got {_name(payload)}")
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises a zoo: ExtraData, FormatError, StackError, ValueError, UnicodeError...
        raise KVEventDecodeError(f"payload: not msgpack ({type(e).__name__}: {e})") from None
    try:
        return _batch(raw)
    except KVEventDecodeError:
        raise
    except Exception as e:  # a shape no check above foresaw must still cost only this batch
        raise KVEventDecodeError(f"payload: {type(e).__name__}: {e}") from None


def _batch(raw: Any) -> EventBatch:
    if isinstance(raw, dict):
        missing = [k for k in ("ts", "events") if k not in raw]
        if missing:
            raise KVEventDecodeError(f"batch: a map without {', '.join(missing)}")
        ts, events, rank = raw["ts"], raw["events"], raw.get("data_parallel_rank")
    elif isinstance(raw, list):
        if len(raw) < 2:
            raise KVEventDecodeError(f"batch: expected [ts, events, data_parallel_rank?], got {len(raw)} elements")
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    else:
        raise KVEventDecodeError(f"batch: expected an array or a map, got {_name(raw)}")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise KVEventDecodeError(f"batch.ts: expected a number, got {_name(ts)}")
    items = _list(events, "batch.events")
    return EventBatch(
        ts=float(ts),
        events=tuple(decode_event(e, f"events[{i}]") for i, e in enumerate(items)),
        data_parallel_rank=_int(rank, "batch.data_parallel_rank", optional=True),
    )


# ------------------------------------------------------------------------ frames

def decode_seq(frame: bytes) -> int:
    """The 8-byte big-endian sequence number; -1 (:data:`END_SEQ`) ends a replay."""
    if not isinstance(frame, (bytes, bytearray, memoryview)) or len(frame) != _SEQ_BYTES:
        size = len(frame) if isinstance(frame, (bytes, bytearray, memoryview)) else _name(frame)
        raise KVEventDecodeError(f"seq: expected {_SEQ_BYTES} bytes, got {size}")
    return int.from_bytes(frame, "big", signed=True)


def encode_seq(seq: int) -> bytes:
    """The frame a replay request carries: the first sequence number wanted."""
    return seq.to_bytes(_SEQ_BYTES, "big", signed=True)


def decode_message(frames: Sequence[bytes]) -> Message:
    """A published message: ``[topic, seq, payload]`` as a SUB socket receives it."""
    if len(frames) != 3:
        raise KVEventDecodeError(f"message: expected 3 frames (topic, seq, payload), got {len(frames)}")
    topic, seq, payload = frames
    try:
        name = bytes(topic).decode("utf-8")
    except Exception:
        raise KVEventDecodeError("topic: not UTF-8") from None
    return Message(name, decode_seq(seq), decode_batch(payload))


def decode_replay(frames: Sequence[bytes]) -> Message | None:
    """A replay answer as a DEALER receives it; None for the end marker (``seq = -1``).

    The replay frames changed too: vLLM 0.13 sends ``[b"", seq, payload]``, 0.32 puts the topic
    in, ``[b"", topic, seq, payload]`` (its end marker: ``[b"", b"", -1, b""]``). A REQ socket
    sees the same without the leading empty delimiter. Three frames therefore read as
    ``[topic, seq, payload]``, which is also right for 0.13's ``[b"", seq, payload]`` (no topic).
    """
    if len(frames) == 4:
        if len(frames[0]):
            raise KVEventDecodeError("replay: the first of 4 frames must be the empty delimiter")
        frames = frames[1:]
    if len(frames) == 2:
        frames = [b"", *frames]
    if len(frames) != 3:
        raise KVEventDecodeError(f"replay: expected [b'', topic, seq, payload], [b'', seq, payload] or "
                                 f"[seq, payload], got {len(frames)} frames")
    seq = decode_seq(frames[1])
    if seq == END_SEQ:
        return None
    try:
        topic = bytes(frames[0]).decode("utf-8")
    except Exception:
        raise KVEventDecodeError("topic: not UTF-8") from None
    return Message(topic, seq, decode_batch(frames[2]))


# ------------------------------------------------------------------------ encoding

# 0.13's positional events: all its fields, none with a default (later fields trail when set).
_POSITIONAL_MIN = {"BlockStored": 6, "BlockRemoved": 2, "AllBlocksCleared": 0}
_FIELDS_OF = {BlockStored: ("BlockStored", BLOCK_STORED_FIELDS), BlockRemoved: ("BlockRemoved", BLOCK_REMOVED_FIELDS),
              AllBlocksCleared: ("AllBlocksCleared", ALL_BLOCKS_CLEARED_FIELDS)}


def _plain(v: Any) -> Any:
    return [_plain(x) for x in v] if isinstance(v, tuple) else v


def encode_event(event: KVEvent, *, positional: bool = False) -> Any:
    """One event as vLLM's msgspec writes it: a map tagged by ``"type"`` (current releases) or,
    with ``positional``, ``[tag, field, ...]`` up to the last field that is set (0.13)."""
    if isinstance(event, UnknownEvent):
        raise TypeError("an UnknownEvent cannot be encoded: its fields are not known")
    tag, names = _FIELDS_OF[type(event)]
    values = [_plain(getattr(event, n)) for n in names]
    if positional:
        end = len(values)
        while end > _POSITIONAL_MIN[tag] and values[end - 1] is None:
            end -= 1
        return [tag, *values[:end]]
    out: dict[str, Any] = {TAG_KEY: tag}
    for i, (name, value) in enumerate(zip(names, values)):
        if value is not None or i < _NO_DEFAULT[tag]:
            out[name] = value
    return out


def encode_batch(batch: EventBatch, *, positional: bool = False) -> bytes:
    """The msgpack payload: ``[ts, events, data_parallel_rank]``, the rank left out when None."""
    raw: list[Any] = [batch.ts, [encode_event(e, positional=positional) for e in batch.events]]
    if batch.data_parallel_rank is not None:
        raw.append(batch.data_parallel_rank)
    return msgpack.packb(raw, use_bin_type=True)


def encode_message(topic: str, seq: int, payload: bytes) -> list[bytes]:
    """The three frames a PUB socket sends: topic, 8-byte big-endian sequence, payload."""
    return [topic.encode("utf-8"), encode_seq(seq), payload]


def encode_replay(topic: str, seq: int, payload: bytes) -> list[bytes]:
    """One replayed batch as 0.32's ROUTER sends it after the peer's identity: ``[b"", topic, seq,
    payload]``."""
    return [b"", *encode_message(topic, seq, payload)]


REPLAY_END = [b"", b"", encode_seq(END_SEQ), b""]  # 0.32's end-of-replay marker
