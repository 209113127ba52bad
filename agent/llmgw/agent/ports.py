"""Engine port selection from the node's configured range.

A port is handed out only if no shard of this agent holds it and it can be
bound right now on the engine's bind address.  The search starts at a random
offset so several agents sharing one host (a simulated fleet, a test) rarely
race for the same port; the bind check cannot close that race entirely (the
engine binds later), and an engine that loses it exits during start, which
is reported as a failure with its output tail like any other.
"""

from __future__ import annotations

import random
import socket


def port_is_bindable(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # No SO_REUSEADDR: a port with a listener, or one in TIME_WAIT that the
        # engine's own bind may still refuse, counts as taken.
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def choose_port(first: int, last: int, host: str, taken: set[int],
                rng: random.Random | None = None) -> int | None:
    """A free port in [first, last] not in ``taken``, or None when the range is exhausted."""
    span = last - first + 1
    start = (rng or random).randrange(span)
    for i in range(span):
        port = first + (start + i) % span
        if port in taken:
            continue
        if port_is_bindable(host, port):
            return port
    return None
