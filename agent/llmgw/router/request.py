"""Reading what the router needs from a client's request: who sent it, its id, ``model`` and ``stream``.

The body is parsed once and never re-serialised: the engine receives the
client's original bytes.  The parsed object is kept only for scorers that
look at the prompt (prefix affinity).  Only headers checked here are
copied into the engine's request.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from llmgw import kvbootstrap

from .auth import AuthFailure, KeyRing, Principal
from .errors import AUTHENTICATION, RouterError, bad_request

_DECODER = json.JSONDecoder()
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")
_HEADER_VALUE = re.compile(r"^[\t\x20-\x7e]{1,1024}$")  # what may be copied into an engine request line

# Fields of the engines' own request schemas that steer a KV transfer between engines
# (vLLM's KV connectors; SGLang's disaggregation). Only the router sets them, for a
# disaggregated model's two phases (``prefill``) or pairs (``dualdispatch``). From a client they would be acted on
# unchecked: a decoder pulls KV blocks from whatever engine, host and block ids they name
# (another tenant's prompt, or an address of the client's choosing), and a prefill engine
# holds the blocks of every such request for a decoder that never comes.
ROUTER_ONLY_FIELDS = ("kv_transfer_params", *kvbootstrap.FIELDS)


# Where the admission step leaves the principal it authenticated, so the proxy
# does not hash the same key a second time (request state: no client can set it).
PRINCIPAL = "llmgw.principal"


def authenticate(keys: KeyRing, request: web.Request) -> Principal:
    """The caller's principal; a 401 ``RouterError`` for a key the router does not know."""
    principal = request.get(PRINCIPAL)
    if principal is not None:
        return principal
    try:
        return keys.authenticate(request.headers.get("Authorization"))
    except AuthFailure as e:
        raise RouterError(401, str(e), AUTHENTICATION, "invalid_api_key", klass="unauthorized") from None


def request_id(request: web.Request) -> str:
    """The client's X-Request-Id when it is acceptable, else a generated one."""
    rid = request.headers.get("X-Request-Id")
    if rid is None or not _REQUEST_ID.match(rid):
        rid = os.urandom(12).hex()
    return rid


def engine_head(request: web.Request, stream: bool, rid: str) -> bytes:
    """The header lines of the engine's request: the client's Accept if it is safe to copy, else the default."""
    accept = request.headers.get("Accept")
    if accept is None or not _HEADER_VALUE.match(accept):
        accept = "text/event-stream" if stream else "application/json"
    # parse_body proved the body is JSON, whatever the client's Content-Type said
    return (b"Content-Type: application/json\r\nAccept: %s\r\nAccept-Encoding: identity\r\n"
            b"X-Request-Id: %s\r\n" % (accept.encode("ascii"), rid.encode("ascii")))


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
    for name in ROUTER_ONLY_FIELDS:
        if name in payload:
            raise bad_request(f"Unsupported parameter: '{name}' steers KV transfers between engines and is set "
                              "by the router only", param=name, code="unsupported_parameter")
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


__all__ = ["PRINCIPAL", "ROUTER_ONLY_FIELDS", "ParsedRequest", "RouterError", "authenticate", "engine_head", "parse_body", "request_id"]
