"""Checking what agents send, before anything else looks at it.

A message that is not JSON, not an object, not one of the agent's own types,
or not valid against the stream schema is a ``MessageProblem``; the agent
service closes that agent's stream over it and nothing else.
"""

from __future__ import annotations

import json
from typing import Any

from llmgw.config import fast_check, schema_errors

MAX_MESSAGE = 4 * 1024 * 1024  # bytes; larger frames close the sender's stream
UP_TYPES = ("register", "heartbeat", "shard_status", "progress")


class MessageProblem(ValueError):
    """Why one message was refused; a complete sentence for the log and the ``error`` message."""


def parse_up(data: str | bytes) -> dict[str, Any]:
    """The message in ``data`` as a dict, or ``MessageProblem`` naming what is wrong and where."""
    if isinstance(data, (bytes, bytearray)):
        raise MessageProblem("binary frame: messages are JSON text frames")
    if len(data) > MAX_MESSAGE:
        raise MessageProblem(f"message of {len(data)} bytes exceeds the {MAX_MESSAGE}-byte limit")
    try:
        msg = json.loads(data)
    except ValueError as e:
        raise MessageProblem(f"not JSON: {e}") from None
    if not isinstance(msg, dict):
        raise MessageProblem(f"not a JSON object but {type(msg).__name__}")
    kind = msg.get("type")
    if kind not in UP_TYPES:
        raise MessageProblem(f"type {kind!r} is not sent by agents (expected one of {', '.join(UP_TYPES)})")
    errors = [] if fast_check("stream", kind)(msg) else schema_errors(msg, "stream", definition=kind)
    if errors:
        shown = "; ".join(str(e) for e in errors[:5])
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        raise MessageProblem(f"invalid {kind} message: {shown}{more}")
    if kind == "register" and msg["hardware"].get("node_id") != msg["node_id"]:
        raise MessageProblem(f"register: hardware.node_id {msg['hardware'].get('node_id')!r} differs from "
                             f"node_id {msg['node_id']!r}")
    return msg


def dumps(msg: dict[str, Any]) -> str:
    return json.dumps(msg, separators=(",", ":"))
