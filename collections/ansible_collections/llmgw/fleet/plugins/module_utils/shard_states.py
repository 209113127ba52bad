# -*- coding: utf-8 -*-
# Copyright: llmgw maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The shard states the control plane's API reports, named once for the collection's plugins.

The plugins run on the Ansible controller, where llmgw need not be installed,
so they cannot import ``llmgw.protocol.ShardState`` (the states an agent
reports on the wire) nor the control plane's own two (``waiting``: not yet
sent to an agent, ``gone``: no longer reported by it).  This is their copy,
and tests/unit/test_collection_shard_states.py holds it equal to both, so a
state added or renamed in llmgw fails that test by name instead of leaving
the inventory plugin grouping a node by a shard that ended.
"""

from __future__ import annotations

# What an agent reports (llmgw.protocol.ShardState, in its order).
PENDING = "pending"
FETCHING = "fetching"
STARTING = "starting"
READY = "ready"
FAILED = "failed"
DRAINING = "draining"
STOPPED = "stopped"
AGENT_STATES = (PENDING, FETCHING, STARTING, READY, FAILED, DRAINING, STOPPED)
TERMINAL_STATES = frozenset((FAILED, STOPPED))  # the engine is gone and its GPUs are free

# The control plane's own (llmgw.controlplane.replicas).
WAITING = "waiting"
GONE = "gone"

# A shard that holds no engine any more, whichever side says so.
ENDED_STATES = TERMINAL_STATES | frozenset((GONE,))
