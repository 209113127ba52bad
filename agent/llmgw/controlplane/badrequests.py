"""One warning line, not an ERROR traceback, for an HTTP request the server cannot parse.

aiohttp answers a malformed request (a NUL in a header, a broken request
line) with 400 and logs it at ERROR with the parser's whole traceback.  The
listener takes TLS connections without a client certificate (an operator
may use a token), so anyone who can reach the port could fill the control
plane's log with tracebacks and trip every alert on "ERROR".  The client's
mistake is not the server's error: it is logged as a warning naming the
peer and the parser's reason, at most once a minute per peer and reason.
"""

from __future__ import annotations

import logging
import time

from aiohttp.http_exceptions import HttpProcessingError

AIOHTTP_SERVER_LOG = "aiohttp.server"
EVERY = 60.0


class MalformedRequestFilter(logging.Filter):
    """Rewrites aiohttp's records of unparsable requests; leaves every other record alone."""

    def __init__(self, clock=time.monotonic) -> None:
        super().__init__()
        self._clock = clock
        self._last: dict[tuple[str, str], float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        peer = str(record.args[0]) if isinstance(record.args, tuple) and record.args else "?"
        reason = next((line.strip() for line in str(exc.message).splitlines() if line.strip()), type(exc).__name__)
        now = self._clock()
        key = (peer, reason)
        if now - self._last.get(key, -EVERY) < EVERY:
            return False
        if len(self._last) > 4096:
            self._last.clear()
        self._last[key] = now
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.msg, record.args = "malformed HTTP request from %s answered %d: %s", (peer, exc.code, reason)
        record.exc_info = record.exc_text = None
        return True


def quiet_malformed_requests() -> None:
    """Install the filter on aiohttp's server log (once per process)."""
    logger = logging.getLogger(AIOHTTP_SERVER_LOG)
    if not any(isinstance(f, MalformedRequestFilter) for f in logger.filters):
        logger.addFilter(MalformedRequestFilter())
