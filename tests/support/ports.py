"""Loopback ports for the processes a test starts."""

from __future__ import annotations

import random
import socket

HOST = "127.0.0.1"


def free_port(host: str = HOST) -> int:
    """A port nothing listens on right now (bound to 0, then closed). Another process may take it
    before ours binds: a start that fails on a taken port is retried with another."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def closed_port(host: str = HOST) -> int:
    """A port with nothing listening: a connection to it is refused."""
    return free_port(host)


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def engine_port_block(size: int) -> int:
    """The first port of ``size`` ports an agent may give its engines, below the kernel's
    ephemeral range (as the agent's default 20000-20999 is).

    Inside that range any outgoing connection of the tests running beside this one can hold a
    port as its local end between the agent's bind check and the engine's own bind: the engine
    then exits with "address already in use", and the control plane counts a failure no test
    asked for (seen as a fourth placement in a test that counts three).
    """
    top = min(_ephemeral_start(), 32768) - size
    return random.randrange(20000, top, size)
