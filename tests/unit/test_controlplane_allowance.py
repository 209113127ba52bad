"""The control plane's books of per-key allowances (controlplane/allowance.py), on a fake clock."""

from __future__ import annotations

import math
import random

from llmgw.controlplane.allowance import CONCURRENT, AllowanceBook, Ask, Denial, Grant, Return

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


def slots(need: int = 1, held: int = 0, limit: int = 4) -> Ask:
    return Ask("k", "", CONCURRENT, limit, 0.0, need, held)


CPOOL = ("k", "", CONCURRENT)


def test_concurrency_slots_are_held_renewed_with_what_runs_and_freed_at_once_when_given_back():
    book = started()
    g, = book.grant(A, [slots()], 0.0)
    assert isinstance(g, Grant) and g.amount == 2  # alone: half of what is free
    g2, = book.grant(B, [slots()], 0.0)
    assert isinstance(g2, Grant) and g2.amount == 1
    assert book.outstanding(CPOOL, 0.0) == 3
    # A renews with its one request running and asks for nothing more: its spare slot goes back
    r, = book.grant(A, [slots(need=0, held=1)], 1.0)
    assert isinstance(r, Grant) and r.amount == 1 and book.outstanding(CPOOL, 1.0) == 2
    # no more than its live lease had can be kept, and renewing replaces the lease rather than adding to it
    r2, = book.grant(A, [slots(need=0, held=4)], 1.5)
    assert r2.amount == 1 and book.outstanding(CPOOL, 1.5) == 2
    # slots are not spent in a window: a lease given back with nothing running frees them at once
    book.settle(B, [Return(g2.lease, unused=1, idle=0)], 1.6)
    assert book.outstanding(CPOOL, 1.6) == 1
    # held slots count until the lease ends, no longer (a dead router's come back within one lease)
    assert book.outstanding(CPOOL, 1.5 + T - 0.01) == 1 and book.outstanding(CPOOL, 1.5 + T) == 0


def test_concurrency_at_the_limit_keeps_what_runs_and_says_when_to_retry():
    book = started()
    a, = book.grant(A, [slots(need=1, limit=2)], 0.0)
    b, = book.grant(B, [slots(need=1, limit=2)], 0.0)
    assert a.amount == b.amount == 1
    d, = book.grant(C, [slots(need=1, limit=2)], 0.0)
    assert isinstance(d, Denial) and d.retry_after == 1.0
    # A, with its one slot in use, asks for a second: it keeps the one, gets no more, and is told to retry
    k, = book.grant(A, [slots(need=1, held=1, limit=2)], 0.5)
    assert isinstance(k, Grant) and k.amount == 1 and k.retry_after == 1.0
    # books that do not know the lease (a restart) grant what runs only from what is free
    book.restart(1.0)
    got = book.grant(A, [slots(need=0, held=2, limit=2)], 1.0 + T)
    assert got[0].amount == 2
    assert isinstance(book.grant(B, [slots(need=0, held=1, limit=2)], 1.0 + T)[0], Denial)


def test_random_holders_never_hold_more_concurrency_slots_than_the_limit():
    """Workers that start requests, end them, renew, return and die: requests running never pass the limit.

    Each worker runs its requests only on slots its lease counts; an ask keeps
    the slots in use when it is sent (no spare slot is taken while it travels).
    A dead worker's requests die with it, and its slots come back within T.
    """
    rng = random.Random(31)
    limit = 6
    book = started()
    names = [(f"r{i}", "w") for i in range(6)]
    # holder -> {"lease", "amount", "in_use", "expires" (holder's clock), "ttl"}
    live: dict = {h: {"lease": None, "amount": 0, "in_use": 0, "expires": 0.0} for h in names}
    dead_at: dict = {}
    deaths: list = []
    now = 0.0
    peak = 0
    for step in range(6000):
        now += rng.expovariate(40.0)
        h = rng.choice(names)
        if h in dead_at:
            if now - dead_at[h] > 3 * T:  # a new worker in its place
                del dead_at[h]
                live[h] = {"lease": None, "amount": 0, "in_use": 0, "expires": 0.0}
            continue
        for k, x in live.items():  # each worker's background loop: renew what runs before the lease ends
            if k not in dead_at and x["lease"] is not None and x["expires"] - now < T / 2:
                if x["in_use"]:
                    _ask(book, k, x, now, rng, need=0, limit=limit)
                else:
                    book.settle(k, [Return(x["lease"], x["amount"], 0.0)], now + rng.uniform(0, 0.05))
                    x["lease"], x["amount"] = None, 0
        w = live[h]
        roll = rng.random()
        if roll < 0.02:  # died: its requests end with it, its lease is never returned
            dead_at[h] = now
            deaths.append(now)
            w["in_use"] = w["amount"] = 0
            continue
        if roll < 0.45 and w["in_use"]:
            w["in_use"] -= 1  # a request ended
        elif roll < 0.85:  # a request arrives
            if w["lease"] is not None and w["expires"] > now and w["in_use"] < w["amount"]:
                w["in_use"] += 1
            else:
                _ask(book, h, w, now, rng, need=1, limit=limit)
        elif w["lease"] is not None and not w["in_use"]:  # idle: gives its lease back early
            book.settle(h, [Return(w["lease"], w["amount"], 0.0)], now + rng.uniform(0, 0.05))
            w["lease"], w["amount"] = None, 0
        running = sum(x["in_use"] for k, x in live.items() if k not in dead_at)
        peak = max(peak, running)
        assert running <= limit, f"{running} requests running at {now}"
        for k, x in live.items():
            if k not in dead_at and x["lease"] is not None and x["expires"] > now:
                assert x["in_use"] <= x["amount"]
        # the books count no more than the limit, and nothing of a worker dead for one lease time
        assert book.outstanding(CPOOL, now) <= limit
        for k, t in dead_at.items():
            if now - t >= T + 0.05:  # its last exchange may have reached the books up to 0.05 s later
                assert not any(x.holder == k and x.expires > now for x in book.leases.values())
    assert peak == limit  # the limit was reached: the test exercised the edge
    assert len(deaths) > 10


def _ask(book: AllowanceBook, h, w: dict, now: float, rng: random.Random, need: int, limit: int) -> None:
    held = min(w["amount"], w["in_use"]) if w["lease"] is not None else w["in_use"]
    w["amount"] = held if w["lease"] is not None else 0  # frozen while the ask travels
    sent = now
    g, = book.grant(h, [slots(need=need, held=held, limit=limit)], now + rng.uniform(0, 0.05))
    if isinstance(g, Grant):
        w["lease"], w["amount"], w["expires"] = g.lease, g.amount, sent + g.ttl
    else:
        w["lease"], w["amount"] = None, 0
