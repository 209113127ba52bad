# -*- coding: utf-8 -*-
# Copyright: llmgw maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The node, replica and cordon states the control plane's API reports, named once for the plugins.

The plugins run on the Ansible controller, where llmgw need not be installed,
so they cannot import ``llmgw.protocol`` (``NodeState``, ``ReplicaState``,
``Cordon``, ``SCHEDULABLE``).  This is their copy, as ``shard_states.py`` is
for shards, and tests/unit/test_collection_fleet_states.py holds it equal to
llmgw's, so a state renamed there fails that test by name instead of leaving
``node_cordon`` waiting for a cordon the API no longer reports, or the
inventory counting no replica as Ready.
"""

from __future__ import annotations

# A node's lifecycle state (llmgw.protocol.NodeState, in its order).
NODE_READY = "ready"
NODE_UNREACHABLE = "unreachable"
NODE_LOST = "lost"
NODE_STATES = (NODE_READY, NODE_UNREACHABLE, NODE_LOST)

# A replica's state (llmgw.protocol.ReplicaState, in its order).
REPLICA_STARTING = "starting"
REPLICA_READY = "ready"
REPLICA_FAILED = "failed"
REPLICA_STOPPING = "stopping"
REPLICA_DRAINING = "draining"
REPLICA_STATES = (REPLICA_STARTING, REPLICA_READY, REPLICA_FAILED, REPLICA_STOPPING, REPLICA_DRAINING)

# An operator's hold on a node (llmgw.protocol.Cordon); a node without one has cordon null.
CORDONED = "cordoned"
DRAINING = "draining"
CORDON_STATES = (CORDONED, DRAINING)
SCHEDULABLE = "schedulable"  # how the API names a node without a cordon (llmgw.protocol.SCHEDULABLE)
