"""Checking what agents send, before anything else looks at it.

A message that is not JSON, not an object, not one of the agent's own types,
or not valid against the stream schema is a ``MessageProblem``; the agent
service closes that agent's stream over it and nothing else.
"""

from __future__ import annotations

import json
from typing import Any

from llmgw.config import fast_check, schema_errors
from llmgw.protocol import MAX_MESSAGE

UP_TYPES = ("register", "heartbeat", "shard_status", "progress", "hardware", "kv_routes", "engine_signals")
SHOWN_ERRORS = 5  # errors named in the refusal; validation stops looking after one more
# No array in an agent's message is anywhere near this long (a node has a few GPUs and shards);
# checked before the schema, whose validation of a 4 MiB array of valid items would hold the
# event loop (every other stream, the admin API, the in-process router) for seconds.
MAX_ARRAY = 1024


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
    except RecursionError:  # a few kB of "[[[[..." is enough; it must close the stream, not escape
        raise MessageProblem("not JSON this server accepts: nested too deeply") from None
    if not isinstance(msg, dict):
        raise MessageProblem(f"not a JSON object but {type(msg).__name__}")
    long = _long_array(msg)
    if long is not None:
        raise MessageProblem(f"{long[0] or '/'}: array of {long[1]} items; agent messages hold at most {MAX_ARRAY}")
    kind = msg.get("type")
    if kind not in UP_TYPES:
        raise MessageProblem(f"type {kind!r} is not sent by agents (expected one of {', '.join(UP_TYPES)})")
    try:
        errors = [] if fast_check("stream", kind)(msg) else schema_errors(msg, "stream", definition=kind,
                                                                          limit=SHOWN_ERRORS + 1)
    except RecursionError:
        raise MessageProblem(f"invalid {kind} message: nested too deeply") from None
    if errors:
        shown = "; ".join(str(e) for e in errors[:SHOWN_ERRORS])
        more = " (and more)" if len(errors) > SHOWN_ERRORS else ""
        raise MessageProblem(f"invalid {kind} message: {shown}{more}")
    if kind == "register" and msg["hardware"].get("node_id") != msg["node_id"]:
        raise MessageProblem(f"register: hardware.node_id {msg['hardware'].get('node_id')!r} differs from "
                             f"node_id {msg['node_id']!r}")
    if kind == "register":
        seen: dict[str, int] = {}
        for i, shard in enumerate(msg["shards"]):
            sid = shard["spec"]["shard_id"]
            if sid in seen:  # one shard cannot run twice on a node: the report cannot be trusted
                raise MessageProblem(f"register: /shards/{i}/spec/shard_id {sid!r} repeats /shards/{seen[sid]}")
            seen[sid] = i
    return msg


def _long_array(doc: Any) -> tuple[str, int] | None:
    """(JSON pointer, length) of the first array longer than ``MAX_ARRAY``, else None; one cheap pass."""
    stack: list[tuple[str, Any]] = [("", doc)]
    while stack:
        where, node = stack.pop()
        if isinstance(node, list):
            if len(node) > MAX_ARRAY:
                return where, len(node)
            stack.extend((f"{where}/{i}", v) for i, v in enumerate(node) if isinstance(v, (list, dict)))
        elif isinstance(node, dict):
            stack.extend((f"{where}/{str(k).replace('~', '~0').replace('/', '~1')}", v) for k, v in node.items()
                         if isinstance(v, (list, dict)))
    return None


def dumps(msg: dict[str, Any]) -> str:
    return json.dumps(msg, separators=(",", ":"))
