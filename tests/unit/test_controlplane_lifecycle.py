"""Node lifecycle rules, with explicit times: no clocks, no processes."""

from __future__ import annotations

from llmgw.controlplane.lifecycle import NodeClock, NodeState, ReplacementLimiter, evaluate, observe
from llmgw.settings import Lifecycle

T = Lifecycle(heartbeat_interval=1, keepalive_interval=1, unreachable_after=3, lost_after=6,
              startup_grace=4, max_unreachable_share=0.55, replacements_per_minute=2)


def clocks(*names: str, seen: float = 0.0) -> dict[str, NodeClock]:
    return {n: NodeClock.seen(seen) for n in names}


def test_silence_moves_ready_to_unreachable_then_lost():
    c = clocks("a", "b", "c")
    for t in (1.0, 2.0, 3.5, 5.0, 6.5):
        c["b"].last_seen = c["c"].last_seen = t
    assert evaluate(c, 3.0, started_at=-100, timings=T).transitions == ()
    ev = evaluate(c, 3.5, started_at=-100, timings=T)
    assert [(t.node_id, t.new) for t in ev.transitions] == [("a", NodeState.UNREACHABLE)]
    assert c["a"].state is NodeState.UNREACHABLE
    assert evaluate(c, 6.0, started_at=-100, timings=T).transitions == ()
    ev = evaluate(c, 6.5, started_at=-100, timings=T)
    assert [(t.node_id, t.new) for t in ev.transitions] == [("a", NodeState.LOST)]
    assert "lost_after" in ev.transitions[0].reason


def test_node_heard_from_again_is_ready():
    c = clocks("a")
    evaluate(c, 4.0, started_at=-100, timings=T)
    assert c["a"].state is NodeState.UNREACHABLE
    clock, tr = observe("a", c["a"], 4.5)
    assert clock.state is NodeState.READY and tr is not None and tr.old is NodeState.UNREACHABLE
    assert evaluate(c, 5.0, started_at=-100, timings=T).transitions == ()


def test_nothing_is_lost_during_startup_grace_and_silence_counts_from_start():
    # The control plane starts at t=100; a node it heard from at t=100 goes
    # silent.  Before 100 + grace nothing may be lost, even past lost_after.
    c = clocks("a", "b", "c", seen=100.0)
    c["b"].last_seen = c["c"].last_seen = 200.0
    ev = evaluate(c, 103.5, started_at=100.0, timings=T)
    assert ev.in_grace
    assert [t.new for t in ev.transitions] == [NodeState.UNREACHABLE]
    # A clock from before the start (last_seen 0) does not count as silence.
    old = {"x": NodeClock.seen(0.0), "y": NodeClock.seen(150.0), "z": NodeClock.seen(150.0)}
    assert evaluate(old, 102.0, started_at=100.0, timings=T).transitions == ()


def test_grace_holds_lost_even_past_lost_after():
    t = Lifecycle(heartbeat_interval=1, keepalive_interval=1, unreachable_after=3, lost_after=6,
                  startup_grace=20, max_unreachable_share=0.9)
    c = clocks("a", "b", "c", seen=0.0)
    c["b"].last_seen = c["c"].last_seen = 50
    ev = evaluate(c, 10.0, started_at=0.0, timings=t)
    assert c["a"].state is NodeState.UNREACHABLE
    assert ev.held == ("a",) and "startup_grace" in (ev.hold_reason or "")
    ev = evaluate(c, 20.5, started_at=0.0, timings=t)
    assert c["a"].state is NodeState.LOST and not ev.held


def test_zone_disruption_declares_nothing_lost():
    c = clocks("a", "b", "c")
    c["c"].last_seen = 100.0  # only c keeps talking: 2 of 3 unreachable = 67% > 55%
    ev = evaluate(c, 10.0, started_at=-100, timings=T)
    assert ev.damped and ev.unreachable_share > 0.55
    assert c["a"].state is NodeState.UNREACHABLE and c["b"].state is NodeState.UNREACHABLE
    assert set(ev.held) == {"a", "b"} and "max_unreachable_share" in (ev.hold_reason or "")
    # The network heals for b: 1 of 3 unreachable, no longer damped.  a's silence counts afresh
    # from the last damped pass (10.0), as after a restart: it may still be reconnecting.
    observe("b", c["b"], 10.5)
    ev = evaluate(c, 11.0, started_at=-100, timings=T, last_damped=ev.last_damped)
    assert not ev.damped and ev.last_damped == 10.0
    assert c["a"].state is NodeState.UNREACHABLE and ev.transitions == ()
    observe("b", c["b"], 15.0)  # b keeps talking
    ev = evaluate(c, 15.9, started_at=-100, timings=T, last_damped=ev.last_damped)
    assert c["a"].state is NodeState.UNREACHABLE
    ev = evaluate(c, 16.1, started_at=-100, timings=T, last_damped=ev.last_damped)
    assert c["a"].state is NodeState.LOST and "lost_after" in ev.transitions[0].reason


def test_nodes_thawing_one_by_one_after_a_disruption_are_not_declared_lost():
    c = clocks("a", "b", "c", "d")
    ev = evaluate(c, 10.0, started_at=-100, timings=T)  # all four silent: damped
    assert ev.damped
    back: list[str] = []
    for t, name in ((11.0, "a"), (12.0, "b"), (13.0, "c"), (14.0, "d")):
        back.append(name)
        for n in back:  # those back keep talking
            observe(n, c[n], t)
        ev = evaluate(c, t + 0.01, started_at=-100, timings=T, last_damped=ev.last_damped)
        assert not any(x.new is NodeState.LOST for x in ev.transitions), (name, ev)
    assert all(x.state is NodeState.READY for x in c.values())


def test_share_at_threshold_is_not_damped():
    c = clocks("a", "b")
    c["b"].last_seen = 100.0  # 1 of 2 = 50% <= 55%
    evaluate(c, 10.0, started_at=-100, timings=T)
    assert c["a"].state is NodeState.LOST


def test_replacement_limiter_allows_per_minute_in_any_minute():
    lim = ReplacementLimiter(per_minute=2)
    assert lim.take(0.0) and lim.take(0.0)
    assert not lim.take(1.0)
    assert not lim.available(59.9)  # a bucket refilled smoothly would have let one more go at 30 s
    assert lim.take(60.0)  # the first of the two is a minute old
    assert lim.take(60.0) and not lim.take(60.0)
    lim.retune(1, 200.0)
    assert lim.take(200.0) and not lim.take(200.0)


def test_replacement_limiter_never_lets_more_than_per_minute_through_a_sliding_minute():
    lim = ReplacementLimiter(per_minute=10)
    made = [t / 10 for t in range(0, 3000) if lim.take(t / 10)]  # asked ten times a second for five minutes
    assert max(sum(1 for u in made if t <= u < t + 60) for t in made) == 10
    assert len(made) == 50
