"""The wire vocabulary shared by the control plane, the agents and the routers.

Both ends of a conversation read the same names from here, so neither side
depends on the other's modules for them: the control plane serving the
router watch no longer imports the router, and a path or a limit changed on
one side cannot drift from the other.  Only constants and the shard-state
enum live here (no I/O, no imports from the rest of the package).

- HTTP paths and headers: the agent stream (WebSocket, node certificates),
  the router watch (long poll of the endpoint set, router certificates) and
  the routers' ejection reports.
- Message limits: the largest agent-stream frame either end accepts.
- Shard states: what an agent reports about each shard (``stream.schema.json``
  holds the same list: a unit test keeps them equal).
"""

from __future__ import annotations

from enum import Enum

# -- paths and headers ---------------------------------------------------------------------

STREAM_PATH = "/v1/agent/stream"  # the agent stream: one mutual-TLS WebSocket per node
WATCH_PATH = "/v1/router/endpoints"  # routers' long poll of the endpoint set (?after=REV[&epoch=E])
EJECTIONS_PATH = "/v1/router/ejections"  # routers' reports of the engines they ejected (POST)
# The leader's term on a watch answer: a router follows a deposed leader's answers no further.
LEADER_EPOCH_HEADER = "X-Llmgw-Leader-Epoch"

# -- limits --------------------------------------------------------------------------------

# The largest agent-stream message (bytes), either direction.  A larger frame closes only its
# sender's stream.  A register with a full hardware inventory is about 20 KB.
MAX_MESSAGE = 4 * 1024 * 1024


# -- shard states --------------------------------------------------------------------------

class ShardState(str, Enum):
    """A shard's state as its agent reports it (transitions: ``llmgw.agent.shardstate``)."""

    PENDING = "pending"
    FETCHING = "fetching"
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    DRAINING = "draining"
    STOPPED = "stopped"

    @property
    def terminal(self) -> bool:
        return self in (ShardState.FAILED, ShardState.STOPPED)
