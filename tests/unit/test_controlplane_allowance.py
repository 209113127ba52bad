"""The control plane's books of per-key allowances (controlplane/allowance.py), on a fake clock."""

from __future__ import annotations

import math
import random

from llmgw.controlplane.allowance import AllowanceBook, Ask, Denial, Grant, Return

T = 2.0  # lease seconds
SPAN = 10.0
A, B, C = ("router-a", "w1"), ("router-b", "w1"), ("router-b", "w2")


def ask(need: int = 1, limit: int = 10, dim: str = "requests") -> Ask:
    return Ask("k", "", dim, limit, SPAN, need)


def started(now: float = 0.0) -> AllowanceBook:
    return AllowanceBook(T, now - T)  # past its first lease time: it grants


def test_a_new_book_grants_nothing_for_one_lease_time_and_a_new_term_starts_from_zero():
    book = AllowanceBook(T, 0.0)
    assert book.holding(0.0) == T and book.holding(T) == 0
    book.grant(A, [ask(10)], T)
    assert book.outstanding(("k", "", "requests"), T) == 10
    book.restart(5.0)  # a failover: the old leader's leases end within T, its books are not ours
    assert book.outstanding(("k", "", "requests"), 5.0) == 0 and book.holding(5.0) == T


def test_slices_shrink_near_the_limit_and_the_sum_granted_never_passes_it():
    book = started()
    g1, = book.grant(A, [ask(1, limit=100)], 0.0)
    assert isinstance(g1, Grant) and g1.amount == 50  # alone: half of what is free
    g2, = book.grant(B, [ask(1, limit=100)], 0.0)
    assert isinstance(g2, Grant) and g2.amount == 12  # two holders: a quarter of the 50 left
    amounts = [g1.amount, g2.amount]
    while True:
        g, = book.grant(C, [ask(1, limit=100)], 0.0)
        if isinstance(g, Denial):
            break
        amounts.append(g.amount)
    assert sum(amounts) == 100 and amounts[-3:] == [1, 1, 1]  # the last units go one at a time
    assert 0 < g.retry_after <= T  # the slices others hold come back at their lease's end at the latest


def test_unused_units_come_back_at_once_and_spent_ones_when_their_window_ends():
    book = started()
    g, = book.grant(A, [ask(1)], 0.0)
    assert g.amount == 5
    assert isinstance(book.grant(B, [ask(10)], 0.0)[0], Denial)
    book.settle(A, [Return(g.lease, unused=3, idle=0.5)], 1.0)  # spent 2, the last 0.5 s ago
    assert book.outstanding(("k", "", "requests"), 1.0) == 2
    g2, = book.grant(B, [ask(8)], 1.0)
    assert isinstance(g2, Grant) and g2.amount == 8  # exactly the room left
    denied, = book.grant(C, [ask(1)], 1.0)
    assert isinstance(denied, Denial) and denied.retry_after <= T
    book.settle(B, [Return(g2.lease, unused=8, idle=0)], 1.5)
    assert book.outstanding(("k", "", "requests"), 0.5 + SPAN - 0.01) == 2
    assert book.outstanding(("k", "", "requests"), 0.5 + SPAN) == 0  # A's spends left the window


def test_a_dead_routers_slice_frees_itself_at_lease_plus_window_and_nobody_else_can_return_it():
    book = started()
    g, = book.grant(A, [ask(10)], 0.0)
    book.settle(B, [Return(g.lease, unused=10, idle=0)], 0.5)  # not B's lease: ignored
    assert book.outstanding(("k", "", "requests"), 0.5) == 10
    assert isinstance(book.grant(B, [ask(1)], T + SPAN - 0.01)[0], Denial)
    g2, = book.grant(B, [ask(1)], T + SPAN)
    assert isinstance(g2, Grant) and g2.amount == 5  # A holds nothing live any more: B alone, half of 10


def test_a_request_larger_than_the_limit_is_denied_for_good():
    d, = started().grant(A, [ask(11)], 0.0)
    assert isinstance(d, Denial) and math.isinf(d.retry_after)


def test_random_holders_never_spend_more_than_the_limit_in_any_window():
    """Workers that spend, return late, return early or die: no window of SPAN holds more than the limit."""
    rng = random.Random(31)
    limit = 25
    book = started()
    holders = [(f"r{i}", "w") for i in range(5)]
    held: dict = {}  # holder -> [lease, balance, expires (holder's clock), last spend]
    spends: list[float] = []
    now = 0.0
    for _ in range(4000):
        now += rng.expovariate(20.0)
        h = rng.choice(holders)
        lease = held.get(h)
        if lease and lease[1] > 0 and lease[2] > now:
            lease[1] -= 1
            lease[3] = now
            spends.append(now)
            continue
        if lease and rng.random() < 0.1:
            del held[h]  # died: never returns it
            continue
        returns = []
        if lease:
            returns = [Return(lease[0], lease[1], now - lease[3] if lease[3] is not None else 0.0)]
        sent = now
        now += rng.uniform(0, 0.05)  # the exchange's way there
        book.settle(h, returns, now)
        g, = book.grant(h, [ask(1, limit=limit)], now)
        held.pop(h, None)
        if isinstance(g, Grant):
            held[h] = [g.lease, g.amount, sent + g.ttl, None]
    assert len(spends) > 3 * limit  # the window turned over several times
    j = 0
    for i, t in enumerate(spends):
        while spends[j] <= t - SPAN:
            j += 1
        assert i - j + 1 <= limit, f"{i - j + 1} spends in the window ending at {t}"
