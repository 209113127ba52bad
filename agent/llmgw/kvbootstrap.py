"""SGLang's request fields that name one prefill/decode transfer (its ``bootstrap_*``).

An SGLang prefill server (``--disaggregation-mode prefill``) runs a bootstrap
server on its ``--host`` at ``--disaggregation-bootstrap-port``; a request of a
pair carries that host and port and a room, the transfer's id, on both the
prefill and the decode request (``srt/entrypoints/openai/protocol.py``: scalar
or one per batch item). The router sets them for every request of such a
model (``router/dualdispatch.py``), the control plane for its pair proof
(``controlplane/pairproof.py``); a client may not (``router/request.py``). A
request naming the fake host runs without any peer: SGLang's own
``/health_generate`` does so on either side, and so does the agent's readiness
probe (``engines/sglang.py``).

Pure logic: no I/O here.
"""

from __future__ import annotations

import secrets
from typing import Any
from urllib.parse import urlsplit

FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
FAKE_HOST = "2.2.2.2"  # srt/disaggregation/utils.py FAKE_BOOTSTRAP_HOST
FAKE = {"bootstrap_host": FAKE_HOST, "bootstrap_room": 0}  # what /health_generate sends
ROOM_BITS = 63  # rooms are non-negative 64-bit integers


def new_room() -> int:
    """A fresh room: random, so two routers never name the same transfer on one prefill server."""
    return secrets.randbits(ROOM_BITS)


def bootstrap_fields(prefill_url: str, bootstrap_port: int, room: int) -> dict[str, Any]:
    """What names the pair in both requests: the prefill's bootstrap server (on its endpoint's host) and the room."""
    return {"bootstrap_host": urlsplit(prefill_url).hostname, "bootstrap_port": bootstrap_port,
            "bootstrap_room": room}
