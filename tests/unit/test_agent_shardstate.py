"""The shard state machine."""

import pytest

from llmgw.agent.shardstate import InvalidTransition, ShardState as S, can_transition, check_transition, exit_outcome


def test_happy_path_and_stop():
    path = [S.PENDING, S.FETCHING, S.STARTING, S.READY, S.DRAINING, S.STOPPED]
    for a, b in zip(path, path[1:]):
        check_transition(a, b)


@pytest.mark.parametrize("state", [S.PENDING, S.FETCHING, S.STARTING, S.READY])
def test_every_live_state_can_fail_or_be_stopped(state):
    assert can_transition(state, S.FAILED)
    assert can_transition(state, S.DRAINING)


@pytest.mark.parametrize("terminal", [S.FAILED, S.STOPPED])
def test_terminal_states_are_final(terminal):
    assert terminal.terminal
    for other in S:
        assert not can_transition(terminal, other)


def test_impossible_transitions_are_refused():
    for a, b in [(S.READY, S.STARTING), (S.STARTING, S.PENDING), (S.DRAINING, S.READY),
                 (S.DRAINING, S.FAILED), (S.READY, S.FETCHING)]:
        with pytest.raises(InvalidTransition):
            check_transition(a, b)


def test_exit_meaning_depends_on_whether_we_asked():
    assert exit_outcome(S.STARTING, stopping=False) is S.FAILED
    assert exit_outcome(S.READY, stopping=False) is S.FAILED
    assert exit_outcome(S.READY, stopping=True) is S.STOPPED
    assert exit_outcome(S.DRAINING, stopping=False) is S.STOPPED
