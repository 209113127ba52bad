"""Router workers spending slices leased from one set of books (router/allowance.py + controlplane/allowance.py).

The exchange is the control plane's own (``allowance_api.exchange``) called
in place of the HTTP POST, on a fake clock; the route and the real
processes are tested in tests/integration/test_fleet_key_allowance.py.
"""

from __future__ import annotations

import asyncio
import math

from llmgw.controlplane.allowance import AllowanceBook
from llmgw.controlplane.allowance_api import exchange
from llmgw.router.allowance import CONCURRENT, Allowance, Unavailable
from llmgw.router.limits import Limiter, Refused, Ticket
from llmgw.router.settings import ApiKey, KeyLimits, KeyRates

LEASE = 2.0
WINDOW = 10.0


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def workers(n: int, book: AllowanceBook, clock: Clock, down: list | None = None, **rates):
    keys = [ApiKey("k", "0" * 64, None, KeyLimits(KeyRates(**rates), default_max_tokens=4, window_seconds=WINDOW))]
    out = []
    for i in range(n):
        al = Allowance(["https://cp"], None, clock=clock, on_outage="refuse")
        lm = Limiter(keys)

        async def post(body, al=al, i=i):
            if down:
                raise Unavailable("down", 1.0)
            status, answer = exchange(book, (f"router-{i // 2}", al.instance), body, clock())
            if status != 200:
                raise Unavailable(answer["error"], answer["retry_after"])
            return answer

        al._post = post
        out.append((al, lm.keys["k"]))
    return out


async def admit(al: Allowance, state, prompt: int = 1, completion: int = 1):
    got = al.take(state, "k", "m", prompt, completion, al.clock())
    for _ in range(2):
        if isinstance(got, (Ticket, Refused)):
            return got
        await al.fetch(got)
        got = al.take(state, "k", "m", prompt, completion, al.clock())
    return got


def test_four_workers_admit_exactly_the_limit_then_serve_again_after_the_window():
    clock = Clock()
    book = AllowanceBook(LEASE, clock.t - LEASE)
    ws = workers(4, book, clock, requests_per_minute=12)

    async def run():
        got = []
        for i in range(40):
            clock.t += 0.01
            al, st = ws[i % 4]
            got.append(await admit(al, st))
        return got

    got = asyncio.run(run())
    admitted = [g for g in got if isinstance(g, Ticket)]
    refused = [g for g in got if isinstance(g, Refused)]
    assert len(admitted) == 12 and len(refused) == 28
    assert all(0 < r.retry_after <= WINDOW + LEASE for r in refused)
    assert refused[0].requests[1] == 0  # x-ratelimit-remaining-requests

    clock.t += WINDOW + LEASE + 0.1  # every slice spent, its window over

    async def later():
        out = []
        for al, st in ws:
            await al._exchange([], clock())  # the return loop's pass: leases that ended go back
        for i in range(4):
            out.append(await admit(*ws[i]))
        return out

    assert all(isinstance(g, Ticket) for g in asyncio.run(later()))


def test_unspent_slices_come_back_to_the_workers_that_need_them():
    clock = Clock()
    book = AllowanceBook(LEASE, clock.t - LEASE)
    (a, sa), (b, sb) = workers(2, book, clock, requests_per_minute=100)

    async def run():
        first = await admit(a, sa)  # a holds half of what is free, spends one
        assert isinstance(first, Ticket)
        held = a.slices[("k", "", "requests")].balance
        assert held == 49
        n = 0
        while isinstance(await admit(b, sb), Ticket):
            n += 1
        assert n == 50  # all but what a holds
        clock.t += LEASE  # a's lease ends: its return frees the 49 it did not spend
        await a._exchange([], clock())
        m = 0
        while isinstance(await admit(b, sb), Ticket):
            m += 1
        return m

    assert asyncio.run(run()) == 49


def test_tokens_settle_into_the_slice_and_a_debt_is_asked_for():
    clock = Clock()
    book = AllowanceBook(LEASE, clock.t - LEASE)
    (a, sa), = workers(1, book, clock, tokens_per_minute=1000)
    lm = Limiter([])

    async def run():
        t = await admit(a, sa, prompt=100, completion=100)
        s = a.slices[("k", "", "tokens")]
        before = s.balance
        lm.settle(t, 50, 10, clock())  # used 60 of the 200 reserved
        assert s.balance == before + 140
        t2 = await admit(a, sa, prompt=10, completion=10)
        lm.settle(t2, 10, s.balance + 500, clock())  # far more than reserved: a debt
        assert s.balance < 0
        t3 = await admit(a, sa, prompt=1, completion=1)
        assert isinstance(t3, Ticket) and s.balance >= 0
        counted = book.outstanding(("k", "", "tokens"), clock())
        return counted

    assert asyncio.run(run()) <= 1000


def test_on_outage_refuse_spends_only_live_slices():
    clock = Clock()
    book = AllowanceBook(LEASE, clock.t - LEASE)
    down: list = []
    (a, sa), = workers(1, book, clock, down, requests_per_minute=10)

    async def run():
        assert isinstance(await admit(a, sa), Ticket)  # a slice of 5
        down.append(True)
        for _ in range(4):
            assert isinstance(await admit(a, sa), Ticket)
        try:
            await admit(a, sa)
        except Unavailable:
            return True
        return False

    assert asyncio.run(run())


def test_a_request_larger_than_the_limit_is_refused_for_good_without_asking():
    clock = Clock()
    book = AllowanceBook(LEASE, clock.t - LEASE)
    (a, sa), = workers(1, book, clock, tokens_per_minute=100)
    got = a.take(sa, "k", "m", 90, 20, clock())
    assert isinstance(got, Refused) and math.isinf(got.retry_after)


def test_what_is_spent_while_a_return_is_on_its_way_is_charged_to_the_next_lease():
    """The books count exactly what the worker spent plus what it still holds, through a top-up."""
    clock = Clock()
    book = AllowanceBook(LEASE, clock.t - LEASE)
    (a, sa), = workers(1, book, clock, requests_per_minute=100)
    pool = ("k", "", "requests")
    inner = a._post
    spent = []

    async def slow_post(body):  # requests keep being admitted on the old lease while the exchange travels
        for _ in range(3):
            spent.append(a.take(sa, "k", "m", 1, 1, clock()))
        return await inner(body)

    async def run():
        spent.append(await admit(a, sa))
        a._post = slow_post
        await a._exchange([(pool, 100, WINDOW, 1)], clock())
        return a.slices[pool].balance

    balance = asyncio.run(run())
    assert len(spent) == 4 and all(isinstance(t, Ticket) for t in spent)
    assert book.outstanding(pool, clock()) == len(spent) + balance


def test_the_gate_on_an_outage_serves_on_its_own_windows_or_refuses_as_configured():
    from llmgw.router.limitsgate import LimitsGate
    from llmgw.router.metrics import RouterMetrics

    clock = Clock()
    book = AllowanceBook(LEASE, clock.t - LEASE)
    down: list = [True]

    def gate(on_outage: str):
        (al, state), = workers(1, book, clock, down, requests_per_minute=3)
        al.on_outage = on_outage
        g = LimitsGate(Limiter([ApiKey("k", "0" * 64, None, KeyLimits(KeyRates(requests_per_minute=3),
                                                                          window_seconds=WINDOW))]), RouterMetrics())
        g.allowance = al
        return g, g.limiter.keys["k"]

    async def run(on_outage: str):
        g, state = gate(on_outage)
        return [await g._shared(g.allowance, state, "k", "m", 1, 1) for _ in range(4)]

    served = asyncio.run(run("serve"))
    assert [type(t) for t in served] == [Ticket, Ticket, Ticket, Refused]  # this worker's own window of 3
    refused = asyncio.run(run("refuse"))
    assert all(isinstance(r, Refused) and r.dimension == "allowance_unavailable" and r.retry_after >= 1
               for r in refused)


def test_a_worker_that_stops_gives_every_slice_back():
    clock = Clock()
    book = AllowanceBook(LEASE, clock.t - LEASE)
    (a, sa), = workers(1, book, clock, requests_per_minute=100)

    async def run():
        assert isinstance(await admit(a, sa), Ticket)  # holds a slice of 50, spent 1
        await a.close()

    asyncio.run(run())
    assert book.outstanding(("k", "", "requests"), clock()) == 1  # only what was spent


def test_once_an_exchange_failed_requests_do_not_each_wait_out_the_timeout():
    """A control plane that accepts and never answers: one request waits for it, the next ones do not."""
    from llmgw.router.allowance import Short

    async def run():
        connections = []

        async def silent(reader, writer):
            connections.append(writer)
            await reader.read(65536)
            await asyncio.sleep(30)

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        al = Allowance([f"http://127.0.0.1:{port}"], None, timeout=0.3, on_outage="refuse")
        short = Short({("k", "", "requests"): (10, 60.0, 1)})
        failed = 0
        for _ in range(5):
            try:
                await al.fetch(short)
            except Unavailable:
                failed += 1
        await al.close()
        server.close()
        return failed, len(connections)

    assert asyncio.run(run()) == (5, 1)


def test_a_standby_redirects_and_the_worker_leases_from_the_next_control_plane():
    """With ha a standby answers 307 to the leader (standby.standby_gate); the worker tries the next address."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from llmgw.controlplane.standby import standby_gate
    from llmgw.protocol import ALLOWANCE_PATH
    from llmgw.router.allowance import Short

    clock = Clock()
    book = AllowanceBook(LEASE, clock.t - LEASE)

    async def leader_handle(request):
        status, answer = exchange(book, ("router-a", (await request.json())["instance"]), await request.json(), clock())
        return web.json_response(answer, status=status)

    async def run():
        leader = web.Application()
        leader.router.add_post(ALLOWANCE_PATH, leader_handle)
        lead = TestServer(leader)
        await lead.start_server()
        elector = type("E", (), {"is_leader": False, "name": "cp-b",
                                 "leader": type("L", (), {"name": "cp-a", "epoch": 2, "url": str(lead.make_url(""))})})()
        standby = web.Application(middlewares=[standby_gate(elector, lambda: 500.0)])
        standby.router.add_post(ALLOWANCE_PATH, leader_handle)
        stand = TestServer(standby)
        await stand.start_server()
        al = Allowance([str(stand.make_url("")), str(lead.make_url(""))], None, timeout=2, clock=clock)
        await al.fetch(Short({("k", "", "requests"): (10, WINDOW, 1)}))
        got = al.slices[("k", "", "requests")]
        held = (got.lease is not None, got.balance, book.outstanding(("k", "", "requests"), clock()))
        await al.close()
        await stand.close()
        await lead.close()
        return held

    assert asyncio.run(run()) == (True, 5, 5)


def test_concurrent_requests_hold_across_workers_renew_while_running_and_come_back():
    """Two slots for a key across four workers: held while requests run, renewed, freed when they end or die."""
    clock = Clock()
    book = AllowanceBook(LEASE, clock.t - LEASE)
    ws = workers(4, book, clock, concurrent_requests=2)
    lm = Limiter([])
    pool = ("k", "", CONCURRENT)
    dead: list = []

    async def loop(dt: float) -> None:
        """Time passes; each live worker's return loop renews or gives back what is due."""
        clock.t += dt
        for al, _ in ws:
            if al not in dead:
                renew, back = al.due(clock())
                await al._exchange([(s.pool, s.limit, 0.0, 0) for s in renew], clock(), give_back=back)

    async def run():
        got = [await admit(*ws[i % 4]) for i in range(8)]
        running = [g for g in got if isinstance(g, Ticket)]
        refused = [g for g in got if isinstance(g, Refused)]
        assert len(running) == 2 and len(refused) == 6  # per worker it would have been 2 each: 8
        assert all(r.dimension == CONCURRENT and r.retry_after >= 1 for r in refused)
        assert book.outstanding(pool, clock()) == 2
        holders = [al for al, _ in ws if al.slices[pool].in_use]
        idle = [w for w in ws if w[0] not in holders]
        # the leases of workers with requests running are renewed: past the first leases' end they still count
        for _ in range(4):
            await loop(LEASE * 0.3)
        assert book.outstanding(pool, clock()) == 2 and clock.t - 100.0 > LEASE
        assert isinstance(await admit(*idle[0]), Refused)
        # a request ends: its worker gives the lease back (nothing runs there) and the books free the slot
        lm.settle(running[0], 1, 1, clock())
        await loop(LEASE * 0.3)
        await loop(LEASE * 0.3)
        assert book.outstanding(pool, clock()) == 1
        await loop(0.5)  # the refused workers' 1 s wait
        assert isinstance(await admit(*idle[1]), Ticket)
        assert isinstance(await admit(*idle[0]), Refused)
        # a worker holding a slot dies (never renews, never returns): its slot comes back within one lease
        dead.extend(al for al in holders if al.slices[pool].in_use)
        for _ in range(4):
            await loop(LEASE * 0.3)
        assert book.outstanding(pool, clock()) == 1  # the survivor's, renewed
        return await admit(*idle[0])

    assert isinstance(asyncio.run(run()), Ticket)


def test_cached_prompt_tokens_weigh_the_keys_weight_in_a_leased_slice_too():
    """Fails before: tickets made from slices ignored cached_prompt_weight and charged cached tokens whole."""
    clock = Clock()
    book = AllowanceBook(LEASE, clock.t - LEASE)
    keys = [ApiKey("k", "0" * 64, None, KeyLimits(KeyRates(tokens_per_minute=1000), default_max_tokens=4,
                                                  window_seconds=WINDOW, cached_prompt_weight=0.0))]
    al = Allowance(["https://cp"], None, clock=clock, on_outage="refuse")
    state = Limiter(keys).keys["k"]

    async def post(body):
        status, answer = exchange(book, ("router-0", al.instance), body, clock())
        return answer
    al._post = post

    async def run():
        t = await admit(al, state, prompt=100, completion=100)
        s = al.slices[("k", "", "tokens")]
        before = s.balance
        Limiter([]).settle(t, 100, 10, clock(), cached=80)  # 80 of the 100 prompt tokens cached, weighing 0
        return s.balance - before

    assert asyncio.run(run()) == 200 - (100 - 80 + 10)
