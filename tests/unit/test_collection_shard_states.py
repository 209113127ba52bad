"""The collection's shard states (``module_utils/shard_states.py``) are llmgw's.

The collection runs on the Ansible controller without llmgw installed, so it
keeps its own copy of the states the control plane's API reports: the wire's
``llmgw.protocol.ShardState`` and the control plane's ``waiting``/``gone``.
This holds the copy to both, naming the state that drifted.
"""

from __future__ import annotations

from llmgw.controlplane import replicas
from llmgw.protocol import ShardState
from tests.support.statewords import PLUGINS, imported_modules, load_module_utils

FLEET = PLUGINS.parent
COPY = PLUGINS / "module_utils" / "shard_states.py"
WHY = "plugins/module_utils/shard_states.py must say what llmgw says"


def test_every_wire_state_is_named_alike_in_the_collection():
    copy = load_module_utils("shard_states")
    for state in ShardState:
        assert getattr(copy, state.name, None) == state.value, f"{WHY}: {state.name} = {state.value!r}"
    assert copy.AGENT_STATES == tuple(s.value for s in ShardState), (
        f"{WHY}: AGENT_STATES {copy.AGENT_STATES} != ShardState {tuple(s.value for s in ShardState)}")


def test_terminal_and_ended_states_agree():
    copy = load_module_utils("shard_states")
    assert copy.TERMINAL_STATES == {s.value for s in ShardState if s.terminal} == replicas.ENDED_STATES, WHY
    assert (copy.WAITING, copy.GONE) == (replicas.WAITING, replicas.GONE), WHY
    assert copy.ENDED_STATES == replicas.ENDED_STATES | {replicas.GONE}, WHY


def test_the_copy_imports_nothing():
    """It is loaded on controllers that have only Ansible: standard library at most, and here nothing."""
    assert imported_modules(COPY) == ["__future__"]


def test_the_plugins_keep_no_list_of_their_own():
    """The inventory plugin's model groups skip ended shards by the shared set, not a literal of its own."""
    plugin = (FLEET / "plugins" / "inventory" / "llmgw.py").read_text()
    assert "module_utils.shard_states import" in plugin
    assert '("failed", "stopped"' not in plugin
