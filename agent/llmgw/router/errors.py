"""OpenAI-shaped errors, as HTTP responses and as in-stream SSE events.

Clients (the official SDKs included) decode ``{"error": {message, type,
param, code}}``; anything else surfaces as an opaque failure, so every
error the router itself produces takes this shape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from aiohttp import web

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
PERMISSION = "permission_error"
NOT_FOUND = "not_found_error"
RATE_LIMIT = "rate_limit_error"
SERVER = "server_error"


@dataclass
class RouterError(Exception):
    """An error answered to the client; ``klass`` is the metrics label."""

    status: int
    message: str
    type: str
    code: str | None = None
    param: str | None = None
    klass: str = "other"
    retry_after: int | None = None

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code, self.param)

    def response(self, request_id: str | None = None) -> web.Response:
        headers = {"Content-Type": "application/json"}
        if request_id:
            headers["X-Request-Id"] = request_id
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        return web.Response(status=self.status, body=self.body(), headers=headers)


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}},
        separators=(",", ":"),
    ).encode()


def sse_error_events(message: str, code: str) -> bytes:
    """An error event followed by ``[DONE]``: how a stream that broke after its
    first byte ends, so the client sees a failure instead of a short answer."""
    return b"data: " + error_body(message, SERVER, code) + b"\n\ndata: [DONE]\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> RouterError:
    return RouterError(400, message, INVALID_REQUEST, code, param, klass="bad_request")
