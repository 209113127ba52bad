"""Reading what routing needs from a request body: ``model`` and ``stream``.

The body is parsed once and never re-serialised: the engine receives the
client's original bytes.  The parsed object is kept only for scorers that
look at the prompt (prefix affinity).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .errors import RouterError, bad_request

_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ParsedRequest:
    model: str
    stream: bool
    payload: dict[str, Any]


def parse_body(body: bytes) -> ParsedRequest:
    """Validate the parts the router relies on; raise a 400 ``RouterError`` naming the field."""
    if not body.strip():
        raise bad_request("request body is empty; expected a JSON object", code="invalid_json")
    try:
        if body[:1] == b"{" and body[1:2] != b"\x00":
            # what json.loads(bytes) does for a UTF-8 object, without its encoding detection in Python
            payload = _DECODER.decode(body.decode("utf-8", "surrogatepass"))
        else:
            payload = json.loads(body)
    except UnicodeDecodeError:
        raise bad_request("request body is not UTF-8 JSON", code="invalid_json") from None
    except json.JSONDecodeError as e:
        raise bad_request(
            f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
            code="invalid_json",
        ) from None
    except RecursionError:
        # Python's decoder recurses once per level: a body of 16 MB of '[' or '{"a":' would
        # otherwise escape as an exception and a 500 of the router's own.
        raise bad_request("request body is nested too deeply", code="invalid_json") from None
    if not isinstance(payload, dict):
        raise bad_request(f"request body must be a JSON object, got {_json_type(payload)}", code="invalid_json")
    model = payload.get("model")
    if model is None:
        raise bad_request("you must provide a model parameter", param="model", code="missing_model")
    if not isinstance(model, str) or not model:
        raise bad_request(f"model must be a non-empty string, got {_json_type(model)}", param="model",
                          code="invalid_model")
    stream = payload.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request(f"stream must be a boolean, got {_json_type(stream)}", param="stream",
                          code="invalid_type")
    return ParsedRequest(model, stream, payload)


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


__all__ = ["ParsedRequest", "RouterError", "parse_body"]
