"""The collection's node, replica and cordon states (``module_utils/fleet_states.py``) are llmgw's.

The collection runs on the Ansible controller without llmgw installed, so it
keeps its own copy of ``llmgw.protocol``'s ``NodeState``, ``ReplicaState``,
``Cordon`` and ``SCHEDULABLE``.  This holds the copy to them, naming the
state that drifted, and keeps the plugins comparing with the copy's names
rather than literals of their own.
"""

from __future__ import annotations

from llmgw.protocol import SCHEDULABLE, Cordon, NodeState, ReplicaState
from tests.support.statewords import API_WORDS, PLUGINS, imported_modules, literal_state_comparisons, load_module_utils

COPY = PLUGINS / "module_utils" / "fleet_states.py"
WHY = "plugins/module_utils/fleet_states.py must say what llmgw.protocol says"
# A literal that is one of those words but means something else there.
NOT_THE_API = {("modules/daemon.py", "stopped"): "a systemd unit's state, the module's own option"}


def test_every_state_is_named_alike_in_the_collection():
    copy = load_module_utils("fleet_states")
    for prefix, enum, together in (("NODE_", NodeState, "NODE_STATES"), ("REPLICA_", ReplicaState, "REPLICA_STATES"),
                                   ("", Cordon, "CORDON_STATES")):
        for state in enum:
            assert getattr(copy, prefix + state.name, None) == state.value, (
                f"{WHY}: {prefix}{state.name} = {state.value!r}")
        assert getattr(copy, together) == tuple(s.value for s in enum), (
            f"{WHY}: {together} {getattr(copy, together)} != {enum.__name__} {tuple(s.value for s in enum)}")
    assert copy.SCHEDULABLE == SCHEDULABLE, WHY


def test_the_copy_imports_nothing():
    """It is loaded on controllers that have only Ansible: nothing beyond __future__."""
    assert imported_modules(COPY) == ["__future__"]


def test_the_plugins_compare_states_by_name():
    found = []
    for path in sorted(PLUGINS.rglob("*.py")):
        rel = path.relative_to(PLUGINS).as_posix()
        if rel.startswith("module_utils/"):
            continue
        found += [f"{rel}:{where}" for word, where in literal_state_comparisons(path, API_WORDS)
                  if (rel, word) not in NOT_THE_API]
    assert not found, "compare with module_utils' names (fleet_states, shard_states): " + "; ".join(found)
