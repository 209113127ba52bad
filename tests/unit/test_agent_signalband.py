"""What an agent sends of its engines' signals: only what moved beyond its dead band, and a refresh."""

from __future__ import annotations

from llmgw.agent.signalband import Deadband, Reading

REFRESH = 30.0


def r(value, band=1.0):
    return Reading(value, band)


def test_the_first_values_go_then_only_moves_beyond_the_dead_band():
    b = Deadband()
    assert b.due(0, {"a": r(2.0), "b": r(0.0)}, REFRESH) == {"a": 2.0, "b": 0.0}
    assert b.due(5, {"a": r(3.0), "b": r(0.5)}, REFRESH) == {}  # 1.0 and 0.5: within the band
    assert b.due(10, {"a": r(3.5), "b": r(0.5)}, REFRESH) == {"a": 3.5}  # 1.5 from the 2.0 last sent
    assert b.due(15, {"a": r(2.6), "b": r(0.5)}, REFRESH) == {}  # measured from 3.5, not from 2.0


def test_a_zero_band_sends_every_change_and_nothing_unchanged():
    b = Deadband()
    b.due(0, {"a": r(0.5, 0.0)}, REFRESH)
    assert b.due(5, {"a": r(0.5, 0.0)}, REFRESH) == {}
    assert b.due(10, {"a": r(0.51, 0.0)}, REFRESH) == {"a": 0.51}


def test_an_engine_that_stops_showing_it_is_said_once_and_again_when_it_comes_back():
    b = Deadband()
    b.due(0, {"a": r(2.0)}, REFRESH)
    assert b.due(5, {"a": r(None)}, REFRESH) == {"a": None}
    assert b.due(10, {"a": r(None)}, REFRESH) == {}
    assert b.due(15, {"a": r(2.0)}, REFRESH) == {"a": 2.0}


def test_a_replica_still_starting_is_not_sent_until_it_shows_a_value():
    b = Deadband()
    assert b.due(0, {"a": r(None)}, REFRESH) == {}
    assert b.due(5, {"a": r(None)}, REFRESH) == {}
    assert b.due(10, {"a": r(1.0)}, REFRESH) == {"a": 1.0}


def test_everything_goes_again_each_refresh_moved_or_not():
    b = Deadband()
    b.due(0, {"a": r(2.0), "b": r(None)}, REFRESH)  # b never showed a value: not sent
    b.due(5, {"a": r(2.0), "b": r(1.0)}, REFRESH)
    assert b.due(29, {"a": r(2.0), "b": r(1.0)}, REFRESH) == {}
    assert b.due(30, {"a": r(2.2), "b": r(1.0)}, REFRESH) == {"a": 2.2, "b": 1.0}
    assert b.due(35, {"a": r(2.2), "b": r(1.0)}, REFRESH) == {}


def test_a_shard_no_longer_asked_for_is_forgotten():
    b = Deadband()
    b.due(0, {"a": r(2.0)}, REFRESH)
    b.due(5, {}, REFRESH)
    assert b.sent == {}
    assert b.due(10, {"a": r(2.0)}, REFRESH) == {"a": 2.0}  # asked again: sent as new
