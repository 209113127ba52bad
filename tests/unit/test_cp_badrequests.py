"""A request aiohttp cannot parse is one warning line per peer and reason a minute, never an ERROR traceback."""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import BadHttpMessage

from llmgw.controlplane.badrequests import MalformedRequestFilter


def record(exc: BaseException | None, peer: str = "10.0.0.9") -> logging.LogRecord:
    info = (type(exc), exc, None) if exc else None
    return logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "Error handling request from %s",
                             (peer,), info)


def test_a_malformed_request_becomes_one_warning_without_traceback_a_minute():
    now = [100.0]
    f = MalformedRequestFilter(clock=lambda: now[0])
    bad = BadHttpMessage("Invalid header value char:\n\n    b'X-Probe: \\x00'\n              ^")
    first = record(bad)
    assert f.filter(first)
    assert first.levelno == logging.WARNING and first.exc_info is None
    assert first.getMessage() == "malformed HTTP request from 10.0.0.9 answered 400: Invalid header value char:"
    assert not f.filter(record(bad)), "the same peer and reason again within a minute: dropped"
    assert f.filter(record(bad, peer="10.0.0.10")), "another peer is still told"
    now[0] += 61
    assert f.filter(record(bad))


def test_other_records_are_left_alone():
    f = MalformedRequestFilter()
    crash = record(RuntimeError("a handler's own bug"))
    assert f.filter(crash) and crash.levelno == logging.ERROR and crash.exc_info is not None
    plain = record(None)
    assert f.filter(plain) and plain.levelno == logging.ERROR
