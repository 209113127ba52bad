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
- Node, replica and cordon states: what the control plane's admin API reports
  and what ``llmgw ctl`` and the Ansible collection read back.  The
  collection, which runs without llmgw installed, keeps a copy in
  ``plugins/module_utils/fleet_states.py`` that a unit test holds equal.

Data carries a state's ``.value`` (a plain string); comparisons may use the
member itself, which equals its value.
"""

from __future__ import annotations

from enum import Enum

# -- paths and headers ---------------------------------------------------------------------

STREAM_PATH = "/v1/agent/stream"  # the agent stream: one mutual-TLS WebSocket per node
WATCH_PATH = "/v1/router/endpoints"  # routers' long poll of the endpoint set (?after=REV[&epoch=E])
EJECTIONS_PATH = "/v1/router/ejections"  # routers' reports of the engines they ejected (POST)
ALLOWANCE_PATH = "/v1/router/allowance"  # routers lease slices of per-key limits (POST)
WAKE_PATH = "/v1/router/wake"  # routers holding requests for a sleeping model ask for its wake (POST)
LOAD_PATH = "/v1/router/load"  # routers' requests in flight per replica, the autoscaler's signal (POST)
# The leader's term on a watch answer: a router follows a deposed leader's answers no further.
LEADER_EPOCH_HEADER = "X-Llmgw-Leader-Epoch"

# -- limits --------------------------------------------------------------------------------

# The largest agent-stream message (bytes), either direction.  A larger frame closes only its
# sender's stream.  A register with a full hardware inventory is about 20 KB.
MAX_MESSAGE = 4 * 1024 * 1024


# -- states --------------------------------------------------------------------------

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


class NodeState(str, Enum):
    """A node's lifecycle state as the control plane judges it (``llmgw.controlplane.lifecycle``)."""

    READY = "ready"  # heard from within unreachable_after
    UNREACHABLE = "unreachable"  # silent past unreachable_after: nothing new is placed there
    LOST = "lost"  # silent past lost_after: its replicas are replaced elsewhere


class ReplicaState(str, Enum):
    """A replica's state in the control plane's book (``llmgw.controlplane.replicas``)."""

    STARTING = "starting"  # placed; not every shard is ready
    READY = "ready"  # every shard ready (rank 0 answered a completion probe)
    FAILED = "failed"  # a shard failed or vanished; restarted after backoff
    STOPPING = "stopping"  # retired: its shards are being stopped
    DRAINING = "draining"  # retired by an operator: finishing in-flight work


class Cordon(str, Enum):
    """An operator's hold on a node; none (``null`` on the wire) is ``SCHEDULABLE``."""

    CORDONED = "cordoned"  # nothing new is placed there
    DRAINING = "draining"  # cordoned, and its replicas are moved elsewhere one at a time


# How the API's answers, logs and ctl name a node without a cordon (its ``cordon`` is null).
SCHEDULABLE = "schedulable"
