"""Shard states and the transitions between them (pure).

    pending -> fetching -> starting -> ready
        \\________\\___________\\_______\\-> failed
    any live state -> draining -> stopped   (asked to stop)
    any live state -> stopped               (stopped before it ever ran)

``failed`` and ``stopped`` are terminal: the shard's engine is gone and its
GPUs are free.  A new start of the same shard id is a new life.  Keeping the
table in one place lets the supervisor refuse an impossible transition
loudly instead of reporting it to the control plane.
"""

from __future__ import annotations

from llmgw.protocol import ShardState


_ALLOWED: dict[ShardState, frozenset[ShardState]] = {
    ShardState.PENDING: frozenset({ShardState.FETCHING, ShardState.STARTING, ShardState.FAILED,
                                   ShardState.DRAINING, ShardState.STOPPED}),
    ShardState.FETCHING: frozenset({ShardState.STARTING, ShardState.FAILED, ShardState.DRAINING,
                                    ShardState.STOPPED}),
    ShardState.STARTING: frozenset({ShardState.READY, ShardState.FAILED, ShardState.DRAINING,
                                    ShardState.STOPPED}),
    ShardState.READY: frozenset({ShardState.FAILED, ShardState.DRAINING, ShardState.STOPPED}),
    # Once asked to stop, however the engine ends, it ended because we asked.
    ShardState.DRAINING: frozenset({ShardState.STOPPED}),
    ShardState.FAILED: frozenset(),
    ShardState.STOPPED: frozenset(),
}


class InvalidTransition(RuntimeError):
    pass


def can_transition(old: ShardState, new: ShardState) -> bool:
    return new in _ALLOWED[old]


def check_transition(old: ShardState, new: ShardState) -> None:
    if not can_transition(old, new):
        raise InvalidTransition(f"shard cannot go from {old.value} to {new.value}")


def exit_outcome(state: ShardState, stopping: bool) -> ShardState:
    """What an engine's exit means, given the state it was in.

    An exit we asked for is ``stopped``; any other exit, during start or after
    it served, is ``failed`` (the control plane's restart policy decides what
    happens next, not the agent).
    """
    if stopping or state is ShardState.DRAINING:
        return ShardState.STOPPED
    return ShardState.FAILED
