"""Send commands to a running simulator's ``--control`` socket.

    python -m llmgw.sim.fleet.client /run/fleet.sock silence 0.6
    python -m llmgw.sim.fleet.client /run/fleet.sock stats

prints the JSON reply; exits 1 when the reply is an error.
"""

from __future__ import annotations

import json
import socket
import sys
from typing import Any


def send_command(path: str, line: str, timeout: float = 120.0) -> dict[str, Any]:
    """One command, one reply (the simulator's JSON line, decoded)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(line.strip().encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(1 << 20)
            if not chunk:
                break
            buf += chunk
    return json.loads(buf)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print("usage: python -m llmgw.sim.fleet.client SOCKET COMMAND [ARGS...]", file=sys.stderr)
        return 2
    reply = send_command(args[0], " ".join(args[1:]))
    print(json.dumps(reply, indent=1))
    return 1 if "error" in reply else 0


if __name__ == "__main__":
    sys.exit(main())
