"""For tests only: hold the control plane's event loop as a long CPU-bound pass would, on a signal.

The leader's lease is renewed from a thread of its own (``leasekeeper``), so
what must be tested is a loop that is *held* while the process runs, not a
process that is stopped: SIGSTOP stops the renewal thread as well.  When the
environment names a file in ``LLMGW_TEST_HOLD_LOOP``, SIGUSR2 makes the loop
spin, holding the interpreter as Python work does, for as long as that file
exists (the test decides how long by removing it).  Without the variable
nothing is installed and SIGUSR2 keeps its default action.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path

log = logging.getLogger("llmgw.controlplane")

HOLD_ENV = "LLMGW_TEST_HOLD_LOOP"


def install(loop: asyncio.AbstractEventLoop) -> bool:
    """Arm SIGUSR2 when ``LLMGW_TEST_HOLD_LOOP`` is set; True when armed."""
    path = os.environ.get(HOLD_ENV)
    if not path:
        return False
    loop.add_signal_handler(signal.SIGUSR2, hold, Path(path))
    log.warning("%s is set (tests only): SIGUSR2 holds the event loop while %s exists", HOLD_ENV, path)
    return True


def hold(path: Path) -> None:
    """Spin on the loop's thread while ``path`` exists."""
    log.warning("holding the event loop while %s exists", path)
    start = time.monotonic()
    while path.exists():
        end = time.monotonic() + 0.01
        while time.monotonic() < end:
            sum(range(1000))
    log.warning("released the event loop after %.1fs", time.monotonic() - start)
