"""Server-sent events at the granularity the relay needs, and no finer.

The relay forwards raw bytes.  It only needs event *boundaries* (so that a
stream cut mid-event is never forwarded half-written, and the router's own
error event starts on a clean line) and, rarely, an event's meaning: before
the first token (to decide whether a retry is still invisible to the
client) and when an event might be an in-band error.  Splitting on blank
lines is a C-level ``rfind``; parsing lines one by one costs several times
more CPU per stream.
"""

from __future__ import annotations

import enum
import json
import re
from typing import Iterator

DONE = b"[DONE]"
ERROR_MARK = b'"error"'  # appears unescaped only as a key or a value, never inside a token's text


class EventBuffer:
    """Accumulates bytes and releases them up to the last complete event."""

    __slots__ = ("_rest",)

    def __init__(self) -> None:
        self._rest = b""

    def feed(self, chunk: bytes) -> bytes:
        if not self._rest and chunk[-2:] == b"\n\n":
            return chunk  # the common case: whole events, nothing pending
        data = self._rest + chunk if self._rest else chunk
        cut = last_boundary(data)
        if cut == 0:
            self._rest = data
            return b""
        if cut == len(data):
            self._rest = b""
            return data
        self._rest = data[cut:]
        return data[:cut]

    @property
    def pending(self) -> bytes:
        """Bytes of an event not yet terminated."""
        return self._rest


def last_boundary(data: bytes) -> int:
    """Offset just past the last blank line (``\\n\\n`` or ``\\r\\n\\r\\n``); 0 if none."""
    a = data.rfind(b"\n\n")
    b = data.rfind(b"\r\n\r\n")
    end_a = a + 2 if a >= 0 else 0
    end_b = b + 4 if b >= 0 else 0
    return max(end_a, end_b)


def iter_events(data: bytes) -> Iterator[bytes]:
    """Event blocks of ``data`` (complete events), without their terminators.

    Lazy: the commit point usually needs only the first event or two of a
    read that may hold dozens, so blocks are cut one at a time, not all at
    once, and only the blocks cut are looked at for CRLF line ends: from the
    first one that has a CR on, the rest is read as if every CRLF were LF.
    """
    start, n = 0, len(data)
    plain = True  # no CR seen yet
    while start < n:
        end = data.find(b"\n\n", start)
        if end < 0:
            end = n
        block = data[start:end]
        if plain and b"\r" in block:
            plain = False
            data = data[start:].replace(b"\r\n", b"\n")
            start, n = 0, len(data)
            continue
        start = end + 2
        if block.strip():
            yield block


def event_data(block: bytes) -> bytes | None:
    """The event's data field (multiple ``data:`` lines joined by newlines), or None."""
    parts = []
    for line in block.split(b"\n"):
        if line.startswith(b"data:"):
            v = line[5:]
            parts.append(v[1:] if v.startswith(b" ") else v)
    return b"\n".join(parts) if parts else None


class Kind(enum.Enum):
    HOLD = "hold"  # carries no output yet: comments, a role-only first chunk
    TOKEN = "token"  # output (or anything else the client must see)
    DONE = "done"
    ERROR = "error"  # the engine reports a failure inside a 200 stream


_OUTPUT_KEYS = ("content", "tool_calls", "function_call", "reasoning_content", "reasoning", "refusal")
# how vLLM (and the simulator) start a chat chunk whose first choice carries text
_CONTENT_CHUNK = b'"choices":[{"index":0,"delta":{"content":"'


# how vLLM (and the simulator) end a stream's first chat chunk, which carries only the role
_ROLE_CHUNK_TAIL = b',"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}'
_JSON_SCALAR = rb'(?:"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9A-Fa-f]{4})*"|-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null)'
# "data: " and the opening of a JSON object of string keys and scalar values, without whitespace
_FLAT_OBJECT_HEAD = re.compile(rb'data: \{(?:"[a-z_]+":%s(?:,"[a-z_]+":%s)*)?' % (_JSON_SCALAR, _JSON_SCALAR))


def _role_only(block: bytes) -> bool:
    """The role-only first chunk, recognised without parsing it: exactly what the JSON path below
    concludes HOLD for (no "error", no "usage", one choice with empty content), and valid JSON,
    because its head is checked to be a flat object of scalars in ASCII."""
    return (block.endswith(_ROLE_CHUNK_TAIL) and block.isascii() and ERROR_MARK not in block
            and b'"usage"' not in block
            and _FLAT_OBJECT_HEAD.fullmatch(block, 0, len(block) - len(_ROLE_CHUNK_TAIL)) is not None)


def classify(block: bytes) -> Kind:
    if _role_only(block):
        return Kind.HOLD
    # The usual first token, recognised without parsing it: no error can be in it (no unescaped
    # "error"), and its first choice's delta has non-empty content, which is what makes an event
    # output below.  Inside JSON strings quotes are escaped, so the marker cannot come from text.
    i = block.find(_CONTENT_CHUNK)
    if i >= 0 and block[i + len(_CONTENT_CHUNK):i + len(_CONTENT_CHUNK) + 1] not in (b'"', b"") \
            and ERROR_MARK not in block:
        return Kind.TOKEN
    data = event_data(block)
    if data is None:
        return Kind.HOLD
    if data.strip() == DONE:
        return Kind.DONE
    try:
        obj = json.loads(data)
    except ValueError:
        return Kind.TOKEN
    if not isinstance(obj, dict):
        return Kind.TOKEN
    if obj.get("error") or obj.get("object") == "error":
        return Kind.ERROR
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices or obj.get("usage"):
        return Kind.TOKEN
    for c in choices:
        if not isinstance(c, dict) or c.get("finish_reason"):
            return Kind.TOKEN
        delta = c.get("delta")
        if isinstance(delta, dict):
            if any(delta.get(k) for k in _OUTPUT_KEYS):
                return Kind.TOKEN
        elif c.get("text") or "text" not in c:
            return Kind.TOKEN
    return Kind.HOLD


def first_output(data: bytes) -> tuple[Kind, bytes] | None:
    """The first event of ``data`` that is not held back (output, [DONE] or an error), with its
    kind; None when every event in it is held (role-only chunks, comments).  This is what decides
    an attempt before its first token."""
    for block in iter_events(data):
        kind = classify(block)
        if kind is not Kind.HOLD:
            return kind, block
    return None


def first_error(data: bytes) -> bytes | None:
    """The data of the first in-band error event in ``data`` (complete events), if any."""
    if ERROR_MARK not in data:
        return None
    for block in iter_events(data):
        if ERROR_MARK in block and classify(block) is Kind.ERROR:
            return event_data(block)
    return None


def ends_with_done(data: bytes) -> bool:
    tail = data[-64:].rstrip()
    if not tail.endswith(DONE):
        return False
    line_start = tail.rfind(b"\n") + 1
    return tail[line_start:].replace(b" ", b"") == b"data:[DONE]"


def error_message(data: bytes | None) -> str:
    """Best-effort human message of an engine's error event."""
    if not data:
        return "engine reported an error"
    try:
        obj = json.loads(data)
    except ValueError:
        return data[:200].decode("utf-8", "replace")
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
        if isinstance(obj.get("message"), str):
            return obj["message"]
    return data[:200].decode("utf-8", "replace")
