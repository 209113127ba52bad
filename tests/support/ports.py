"""Loopback ports for the processes a test starts."""

from __future__ import annotations

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
