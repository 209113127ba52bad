"""HTTP/1.1 response framing for the upstream client: the head, and the body's length.

Only what a reverse proxy talking to known engines needs: the status, the
headers (names lower-cased), how the body is delimited (Content-Length,
chunked, or until the connection closes) and whether the connection may
be reused.  Anything malformed raises ``ProtocolError``, which the router
treats like a dropped connection.  Pure functions and one small decoder,
so framing is tested without sockets.
"""

from __future__ import annotations

import re
from functools import partial

import httptools

MAX_HEAD = 64 * 1024  # bytes of a response head, status line and headers together

NO_BODY, LENGTH, CHUNKED, UNTIL_CLOSE = 0, 1, 2, 3  # Head.framing

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


# The primer is the head of a body the parser is told is chunked; its "close" makes bytes after
# the body's end a parse error, which is how they are noticed.
_PRIMER = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
# what the parser appends between body pieces: empty, so joining the pieces ignores them
_CHUNK_START, _CHUNK_END, _BODY_END = bytearray(), bytearray(), bytearray()
_SIZE_LINE = re.compile(rb"[0-9A-Fa-f]+[ \t]*(?:;[^\r\n]*)?")
_HUGE_SIZE = re.compile(rb"0*[1-9A-Fa-f][0-9A-Fa-f]{15}")  # 2**60 bytes or more
_LINE_HEAD = 64  # bytes kept of a line split across reads: enough to see its size


class ChunkedDecoder:
    """Incremental decoder of a chunked body: ``feed(bytes) -> (payload, ended)``.

    The framing is parsed in C by llhttp (``httptools``), primed with a
    synthetic head: decoding a read's dozens of chunks one by one in Python
    was a quarter of the router's CPU per stream.  Each parser callback is a
    C-level ``list.append`` (a chunk's bytes, or an empty marker where a
    chunk starts and ends and where the body ends), so no Python runs per
    chunk.  Bytes after the final chunk set ``extra`` (the connection then
    cannot be reused).  A declared chunk size of 2**60 bytes or more is
    refused like any other malformed size line.
    """

    __slots__ = ("_parser", "_out", "_line", "_ended", "extra",
                 "on_body", "on_chunk_header", "on_chunk_complete", "on_message_complete")

    def __init__(self) -> None:
        out: list = []
        self._out = out
        # read once by the parser; none refers back to the decoder, so there is no reference cycle
        self.on_body = out.append
        self.on_chunk_header = partial(out.append, _CHUNK_START)
        self.on_chunk_complete = partial(out.append, _CHUNK_END)
        self.on_message_complete = partial(out.append, _BODY_END)
        parser = httptools.HttpResponseParser(self)
        parser.set_dangerous_leniencies(lenient_spaces_after_chunk_size=True)  # RFC 9112's BWS
        parser.feed_data(_PRIMER)
        self._parser = parser
        self._line = b""  # the start of the line the last read ended in: see _open_chunk
        self._ended = False
        self.extra = False

    def feed(self, data: bytes) -> tuple[bytes, bool]:
        if self._ended:
            if data:
                self.extra = True
            return b"", True
        out = self._out
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as e:
            if not out or out[-1] is not _BODY_END:
                out.clear()
                raise ProtocolError(f"bad chunked body: {e}") from None
            self.extra = True
        if out:
            last = out[-1]
            if last is _BODY_END:
                self._ended = True
                # CR/LF after the end is skipped by the parser, not refused; the terminator has 4
                if len(data) - len(data.rstrip(b"\r\n")) > 4:
                    self.extra = True
            elif last is not _CHUNK_END:
                self._open_chunk(data, out)
            payload = b"".join(out)
            out.clear()
        else:
            payload = b""
        i = data.rfind(b"\n")
        if i >= 0:
            self._line = data[i + 1:i + 1 + _LINE_HEAD]
        elif len(self._line) < _LINE_HEAD:
            self._line = (self._line + data[:_LINE_HEAD])[:_LINE_HEAD]
        return payload, self._ended

    def _open_chunk(self, data: bytes, out: list) -> None:
        """The read ended inside a chunk: check its declared size, if its size line ended in this read."""
        size = 0
        for x in reversed(out):
            if x is _CHUNK_START:
                break
            if x is _CHUNK_END:
                return
            size += len(x)
        else:
            return  # the chunk started in an earlier read, where its size line was checked
        end = len(data) - size - 2  # where the size line's CRLF starts
        if end >= 0 and data[end:end + 2] != b"\r\n":
            return  # not a size line: the last chunk's trailer fields, cut mid-line
        start = data.rfind(b"\n", 0, max(end, 0)) + 1
        if start:
            line = data[start:end]
        elif end >= 0:  # the line started in an earlier read
            line = self._line + data[:end] if len(self._line) < _LINE_HEAD else self._line
        else:  # its CR too
            line = self._line[:-1]
        if len(line) >= 16 and _SIZE_LINE.fullmatch(line) and _HUGE_SIZE.match(line):
            raise ProtocolError(f"chunk size too large {line[:40]!r}")
