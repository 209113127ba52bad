"""The upstream client: response framing (http1) and the keep-alive pool (upstream).

Framing is fed byte-exact responses, split at every possible point, so a
read boundary can never change what is decoded.  The pool runs against a
raw asyncio server that answers with scripted bytes.
"""

from __future__ import annotations

import asyncio

import pytest

from llmgw.router.http1 import CHUNKED, LENGTH, NO_BODY, UNTIL_CLOSE, ChunkedDecoder, ProtocolError, parse_head
from llmgw.router.upstream import ConnectError, Disconnected, Pool
from tests.support.polling import run_async as run
from tests.support.ports import closed_port

EVENTS = [b"data: {\"n\":%d}\n\n" % i for i in range(5)]


def chunked(parts: list[bytes], trailer: bytes = b"") -> bytes:
    return b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in parts) + b"0\r\n" + trailer + b"\r\n"


def decode_in_pieces(data: bytes, cuts: list[int]) -> tuple[bytes, bool, bool]:
    d = ChunkedDecoder()
    out, ended, prev = [], False, 0
    for c in cuts + [len(data)]:
        payload, ended = d.feed(data[prev:c])
        out.append(payload)
        prev = c
    return b"".join(out), ended, d.extra


# ---------------------------------------------------------------- framing

def test_chunked_body_decodes_the_same_however_the_reads_split_it():
    data = chunked(EVENTS, trailer=b"X-Checksum: 1\r\n")
    want = b"".join(EVENTS)
    for cut in range(len(data) + 1):
        assert decode_in_pieces(data, [cut]) == (want, True, False), cut
    assert decode_in_pieces(data, list(range(1, len(data)))) == (want, True, False)


def test_chunk_extensions_and_upper_case_sizes_are_accepted():
    d = ChunkedDecoder()
    assert d.feed(b"A;name=value\r\n0123456789\r\n0\r\n\r\n") == (b"0123456789", True)


def test_bytes_after_the_last_chunk_make_the_connection_unusable():
    d = ChunkedDecoder()
    payload, ended = d.feed(chunked([b"x"]) + b"HTTP/1.1 200 OK\r\n")
    assert (payload, ended, d.extra) == (b"x", True, True)


@pytest.mark.parametrize("bad", [b"zz\r\nab\r\n", b"0x2\r\nab\r\n", b"-2\r\nab\r\n", b"2\r\nabXY",
                                 b"1_0\r\n" + b"a" * 16 + b"\r\n", b"f" * 16 + b"\r\n"])
def test_malformed_chunks_are_protocol_errors(bad):
    with pytest.raises(ProtocolError):
        ChunkedDecoder().feed(bad)


def test_a_size_line_that_never_ends_is_a_protocol_error():
    d = ChunkedDecoder()
    d.feed(b"1")
    with pytest.raises(ProtocolError):
        d.feed(b"0" * 5000)


def test_a_huge_declared_size_is_refused_wherever_the_reads_split_it():
    data = chunked([b"x"])[:-5] + b"f" * 16 + b"\r\nabc"
    for cut in range(len(data) + 1):
        with pytest.raises(ProtocolError):
            decode_in_pieces(data, [cut])
    with pytest.raises(ProtocolError):
        decode_in_pieces(data, list(range(1, len(data))))


def test_sizes_with_leading_zeros_and_hex_looking_bodies_and_trailers_decode():
    parts = [b"f" * 20, b"0123456789abcdef0123\r\n", b"\r\nfffffffffffffffff"]
    data = b"".join(b"0000000000%x\r\n%b\r\n" % (len(p), p) for p in parts) + \
        b"0\r\nffffffffffffffffff: 1\r\n\r\n"
    want = b"".join(parts)
    for cut in range(len(data) + 1):
        for cut2 in range(cut, len(data) + 1, 7):
            assert decode_in_pieces(data, [cut, cut2]) == (want, True, False), (cut, cut2)


def test_whitespace_before_extensions_is_accepted_and_bad_extensions_are_not():
    assert ChunkedDecoder().feed(b"1 \t;a=b\r\nx\r\n0\r\n\r\n") == (b"x", True)
    with pytest.raises(ProtocolError):
        ChunkedDecoder().feed(b"1;a b\r\nx\r\n0\r\n\r\n")


def test_line_ends_after_the_last_chunk_make_the_connection_unusable():
    d = ChunkedDecoder()
    assert d.feed(chunked([b"x"]) + b"\r\n") == (b"x", True) and d.extra
    d = ChunkedDecoder()
    assert d.feed(chunked([b"x"])) == (b"x", True) and not d.extra
    assert d.feed(b"\r\n") == (b"", True) and d.extra


def test_a_chunk_cut_short_is_never_reported_as_the_end():
    data = chunked(EVENTS)
    for cut in range(len(data)):
        d = ChunkedDecoder()
        payload, ended = d.feed(data[:cut])
        assert not ended and b"".join(EVENTS).startswith(payload), cut


def test_response_heads():
    h = parse_head(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                   b"X-A: 1\r\nx-a: 2")
    assert (h.status, h.framing, h.keep_alive) == (200, CHUNKED, True)
    assert h.headers["content-type"] == "text/event-stream" and h.headers["x-a"] == "1, 2"
    h = parse_head(b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: 12\r\nRetry-After: 3\r\nConnection: close")
    assert (h.status, h.framing, h.length, h.keep_alive, h.headers["retry-after"]) == (429, LENGTH, 12, False, "3")
    assert parse_head(b"HTTP/1.1 200 OK").framing == UNTIL_CLOSE
    assert parse_head(b"HTTP/1.1 200 OK").keep_alive is False
    assert parse_head(b"HTTP/1.1 204 No Content").framing == NO_BODY
    assert parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: 0").framing == NO_BODY
    assert parse_head(b"HTTP/1.0 200 OK\r\nContent-Length: 1").keep_alive is False
    assert parse_head(b"HTTP/1.0 200 OK\r\nContent-Length: 1\r\nConnection: keep-alive").keep_alive is True


@pytest.mark.parametrize("bad", [b"HTTP/2 200 OK", b"HTTP/1.1 20 OK", b"ICY 200 OK", b"HTTP/1.1 200 OK\r\nno colon",
                                 b"HTTP/1.1 200 OK\r\nbad name: x", b"HTTP/1.1 200 OK\r\nContent-Length: -1",
                                 b"HTTP/1.1 200 OK\r\n folded: x"])
def test_malformed_heads_are_protocol_errors(bad):
    with pytest.raises(ProtocolError):
        parse_head(bad)


# ---------------------------------------------------------------- the pool

class Scripted:
    """A raw TCP server; ``answer(request_bytes, writer)`` writes the response."""

    def __init__(self, answer):
        self.answer = answer
        self.connections = 0
        self.requests: list[bytes] = []

    async def start(self) -> "Scripted":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def _serve(self, reader, writer):
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                if not await self.answer(head + body, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    async def stop(self):
        self.server.close()


async def keep_alive_ok(req, w):
    w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
    await w.drain()
    return True


@run
async def test_connections_are_reused_and_the_request_is_what_was_asked():
    s = await Scripted(keep_alive_ok).start()
    pool = Pool(s.url + "/prefix/", connect_timeout=2, keepalive=4)
    for _ in range(3):
        conn = await pool.request(b"/v1/x?q=1", b"X-Request-Id: r1\r\n", b'{"a":1}')
        assert conn.head.status == 200 and await conn.read_all() == b"{}"
        conn.release()
    assert s.connections == 1
    port = s.url.rsplit(":", 1)[1]
    assert s.requests[0] == (b"POST /prefix/v1/x?q=1 HTTP/1.1\r\nHost: 127.0.0.1:%s\r\nX-Request-Id: r1\r\n"
                             b"Content-Length: 7\r\n\r\n{\"a\":1}" % port.encode())
    pool.close()
    await s.stop()


@run
async def test_a_connection_idle_for_the_keepalive_is_not_reused():
    s = await Scripted(keep_alive_ok).start()
    pool = Pool(s.url, connect_timeout=2, keepalive=0.05)
    conn = await pool.request(b"/", b"", b"")
    await conn.read_all()
    conn.release()
    await asyncio.sleep(0.1)
    pool.sweep()
    assert conn.closed
    conn = await pool.request(b"/", b"", b"")
    await conn.read_all()
    conn.release()
    assert s.connections == 2
    pool.close()
    await s.stop()


@run
async def test_connection_close_unread_bodies_and_interim_answers():
    async def answer(req, w):
        if b"/close" in req:
            w.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 1\r\n\r\nx")
        elif b"/big" in req:
            w.write(b"HTTP/1.1 500 Oops\r\nContent-Length: 10\r\n\r\n0123456789")
        else:
            w.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                    + chunked(EVENTS))
        await w.drain()
        return True
    s = await Scripted(answer).start()
    pool = Pool(s.url, connect_timeout=2, keepalive=4)
    conn = await pool.request(b"/close", b"", b"")
    assert await conn.read_all() == b"x"
    conn.release()
    assert conn.closed  # the engine said close
    conn = await pool.request(b"/big", b"", b"")
    assert conn.head.status == 500 and await conn.read_all(4) == b"0123"
    conn.release()
    assert conn.closed  # body left unread: not reusable
    conn = await pool.request(b"/chunked", b"", b"")
    assert conn.head.status == 200 and await conn.read_all() == b"".join(EVENTS)
    conn.release()
    assert not conn.closed
    assert s.connections == 3
    pool.close()
    await s.stop()


@run
async def test_a_body_cut_short_is_disconnected_after_what_arrived():
    async def cut(req, w):
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(EVENTS[:2])[:-5])
        await w.drain()
        return False
    s = await Scripted(cut).start()
    pool = Pool(s.url, connect_timeout=2, keepalive=4)
    conn = await pool.request(b"/", b"", b"")
    got = b""
    with pytest.raises(Disconnected):
        while True:
            data = await conn.read()
            assert data, "a cut body must not look like a complete one"
            got += data
    assert got == b"".join(EVENTS[:2])
    conn.close()
    pool.close()
    await s.stop()


@run
async def test_garbage_instead_of_a_response_is_a_protocol_error():
    async def garbage(req, w):
        w.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await w.drain()
        return True
    s = await Scripted(garbage).start()
    pool = Pool(s.url, connect_timeout=2, keepalive=4)
    with pytest.raises(ProtocolError):
        await pool.request(b"/", b"", b"")
    pool.close()
    await s.stop()


@run
async def test_connect_refused_is_a_connect_error():
    port = closed_port()
    pool = Pool(f"http://127.0.0.1:{port}", connect_timeout=2, keepalive=4)
    with pytest.raises(ConnectError) as e:
        await pool.request(b"/", b"", b"")
    assert "refused" in e.value.reason.lower()
