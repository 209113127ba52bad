"""HTTP/1.1 response framing for the upstream client: the head, and the body's length.

Only what a reverse proxy talking to known engines needs: the status, the
headers (names lower-cased), how the body is delimited (Content-Length,
chunked, or until the connection closes) and whether the connection may
be reused.  Anything malformed raises ``ProtocolError``, which the router
treats like a dropped connection.  Pure functions and one small state
machine, so framing is tested without sockets.
"""

from __future__ import annotations

import re

MAX_HEAD = 64 * 1024  # bytes of a response head, status line and headers together
_MAX_SIZE_LINE = 4096  # a chunk-size line, extensions included

NO_BODY, LENGTH, CHUNKED, UNTIL_CLOSE = 0, 1, 2, 3  # Head.framing

# a chunk-size line: the size (at most 15 hex digits) and any extensions, which are ignored
_SIZE_LINE = re.compile(rb"([0-9A-Fa-f]{1,15})[ \t]*(?:;[^\r\n]*)?\r\n")
_DIGITS = re.compile(rb"[0-9]{1,18}")
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


class ProtocolError(Exception):
    """The engine's bytes are not a well-formed HTTP/1.x response."""


class Head:
    """A parsed response head."""

    __slots__ = ("status", "headers", "framing", "length", "keep_alive")

    def __init__(self, status: int, headers: dict[str, str], framing: int, length: int, keep_alive: bool) -> None:
        self.status = status
        self.headers = headers  # lower-cased names; repeated headers joined with ", "
        self.framing = framing
        self.length = length  # for LENGTH
        self.keep_alive = keep_alive


def parse_head(raw: bytes) -> Head:
    """Parse a response head (without its terminating blank line)."""
    lines = raw.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or parts[0] not in (b"HTTP/1.1", b"HTTP/1.0") or len(parts[1]) != 3 \
            or not parts[1].isdigit():
        raise ProtocolError(f"bad status line {lines[0][:80]!r}")
    status = int(parts[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not _TOKEN.fullmatch(name):
            raise ProtocolError(f"bad header line {line[:80]!r}")
        key = name.decode("ascii").lower()
        val = value.strip(b" \t").decode("latin-1")
        prev = headers.get(key)
        headers[key] = val if prev is None else f"{prev}, {val}"
    http11 = parts[0] == b"HTTP/1.1"
    conn = headers.get("connection", "").lower()
    keep_alive = ("close" not in conn) if http11 else ("keep-alive" in conn)
    length = 0
    te = headers.get("transfer-encoding")
    if status < 200 or status in (204, 304):
        framing = NO_BODY
    elif te is not None:
        if te.rsplit(",", 1)[-1].strip().lower() == "chunked":
            framing = CHUNKED
        else:  # a final coding other than chunked: the body ends when the connection does
            framing, keep_alive = UNTIL_CLOSE, False
    elif "content-length" in headers:
        cl = headers["content-length"].encode("latin-1")
        if not _DIGITS.fullmatch(cl):
            raise ProtocolError(f"bad Content-Length {cl[:40]!r}")
        length = int(cl)
        framing = LENGTH if length else NO_BODY
    else:
        framing, keep_alive = UNTIL_CLOSE, False
    return Head(status, headers, framing, length, keep_alive)


_SIZE, _DATA, _CRLF, _TRAILER, _DONE = 0, 1, 2, 3, 4


class ChunkedDecoder:
    """Incremental decoder of a chunked body: ``feed(bytes) -> (payload, ended)``.

    An engine sends one chunk per event, and a read holds one or dozens of
    them; a chunk that arrived whole (the usual case) costs one pass of the
    loop.  Bytes after the final chunk set ``extra`` (the connection then
    cannot be reused).
    """

    __slots__ = ("_state", "_left", "_pending", "extra")

    def __init__(self) -> None:
        self._state = _SIZE
        self._left = 0
        self._pending = b""
        self.extra = False

    def feed(self, data: bytes) -> tuple[bytes, bool]:
        if self._pending:
            data = self._pending + data
            self._pending = b""
        out: list[bytes] = []
        size_line = _SIZE_LINE.match
        pos, n = 0, len(data)
        state = self._state
        while pos < n:
            if state == _SIZE:
                m = size_line(data, pos)
                if m is None:
                    i = data.find(b"\r\n", pos)
                    if i >= 0 or n - pos > _MAX_SIZE_LINE:
                        raise ProtocolError(f"bad chunk size line {data[pos:pos + 20]!r}")
                    self._pending = data[pos:]  # the line's end has not arrived yet
                    break
                left = int(m.group(1), 16)
                pos = m.end()
                if not left:
                    state = _TRAILER
                    continue
                end = pos + left
                if end + 2 <= n:  # the whole chunk is here
                    if data[end:end + 2] != b"\r\n":
                        raise ProtocolError("chunk not followed by CRLF")
                    out.append(data[pos:end])
                    pos = end + 2
                    continue
                self._left = left
                state = _DATA
            elif state == _DATA:
                end = pos + self._left
                if end <= n:
                    out.append(data[pos:end])
                    self._left = 0
                    pos = end
                    state = _CRLF
                else:
                    out.append(data[pos:])
                    self._left = end - n
                    pos = n
            elif state == _CRLF:
                if n - pos < 2:
                    self._pending = data[pos:]
                    break
                if data[pos:pos + 2] != b"\r\n":
                    raise ProtocolError("chunk not followed by CRLF")
                pos += 2
                state = _SIZE
            elif state == _TRAILER:
                i = data.find(b"\r\n", pos)
                if i < 0:
                    self._pending = data[pos:]
                    if len(self._pending) > MAX_HEAD:
                        raise ProtocolError("trailer too long")
                    break
                empty = i == pos
                pos = i + 2
                if empty:  # the blank line after the trailer fields: the body ended
                    state = _DONE
                    break
            else:  # _DONE
                break
        self._state = state
        if state == _DONE and pos < n:
            self.extra = True
        if not out:
            return b"", state == _DONE
        return (out[0] if len(out) == 1 else b"".join(out)), state == _DONE
