"""One router worker's slices of limited keys' allowances, leased from the control plane.

With a control plane (``allowance.mode: shared``), a limited key's window
limits (requests, tokens in, out and total per window, tokens per day) are
not counted by the worker's own windows: each worker spends *slices* leased
from the control plane's books (``controlplane/allowance.py``), so the
key's limit holds across every router and worker.  One slice per key,
scope (the key's own limits, or a ``per_model`` block) and dimension.

* **No round trip per request**: admission takes from the slices held
  (``take``, synchronous, no I/O); only a request that finds a slice short
  or past its lease waits for one exchange with the control plane, and one
  exchange at a time per worker (the rest wait for it and look again).
* **Refreshed before it runs out**: a slice spent below a quarter of its
  grant is topped up in the background while the pool is far from its
  limit; near it nothing is fetched ahead, so the last units of a window go
  to the workers whose requests need them.
* **Returned**: a slice is given back (what it did not spend, and how long
  ago it last spent) when its lease ends or when the worker asks for the
  same pool again; the books free the unspent part at once.
* **Tokens settle into the slice**: a request that used fewer tokens than
  it reserved gives the difference back to the slice it took them from
  (while that lease lasts); one that used more leaves a debt that the next
  ask covers, so the books hear of every token.
* **Leases end on our clock first**: a lease's end counts from when the
  ask was sent, which precedes the grant, so a worker never spends a slice
  the control plane already counts as ended.

* **Concurrency slots are held, not spent** (``Slots``): a request takes a
  slot of the worker's lease on the key's ``concurrent_requests`` pool and
  gives it back when it ends (``Limiter.settle``).  The lease is renewed
  while requests run (when less than half of it is left) with the slots in
  use, and the spare ones go back to the books then; a worker with none
  running returns the lease.  What a renewal or ask keeps is frozen when it
  is sent (no spare slot is taken while it is on its way), so a worker never
  runs more requests than the books count for it.

``on_outage`` decides what happens when the control plane does not answer
(``serve``: spend the slices held past their lease, then each worker's own
windows and concurrency; ``refuse``: 429).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import ssl
import time
from dataclasses import dataclass
from typing import Any, Sequence

import aiohttp

from llmgw.protocol import ALLOWANCE_PATH

from .limits import BUDGET, NAMES, REQUESTS, KeyState, RateView, Refused, Rule, Ticket

log = logging.getLogger("llmgw.router.allowance")

__all__ = ["Allowance", "Slice", "Slots", "Unavailable", "Short", "CONCURRENT"]

CONCURRENT = "concurrent_requests"  # the pool dimension of slots held while a request runs

TOP_UP_BELOW = 0.25  # share of a grant left when a background top-up starts
RETURN_EVERY = 0.5  # seconds between looks for slices whose lease has ended
DOWN_FOR = 1.0  # after a failed exchange, requests go straight to on_outage for this long


class Unavailable(Exception):
    """The control plane did not answer an exchange (down, unreachable, standby, books still new)."""

    def __init__(self, why: str, retry_after: float = 1.0) -> None:
        super().__init__(why)
        self.retry_after = retry_after


class Slice:
    """What this worker holds of one pool; ``adjust`` is a ``limits.Window``'s, for ``Limiter.settle``."""

    __slots__ = ("pool", "limit", "span", "lease", "balance", "granted", "expires", "last_spend", "spent",
                 "remaining", "reset_at", "denied_until", "retry_after")

    def __init__(self, pool: tuple[str, str, str], limit: int, span: float) -> None:
        self.pool = pool
        self.limit = limit
        self.span = span
        self.lease: str | None = None
        self.balance = 0  # units left of the lease; negative: a debt the next ask covers
        self.granted = 0
        self.expires = 0.0  # on this worker's monotonic clock
        self.last_spend = 0.0
        self.spent = False
        self.remaining = limit  # free in the books after our last grant
        self.reset_at = 0.0
        self.denied_until = 0.0  # the books said no until then
        self.retry_after = 0.0

    def enough(self, need: int, now: float) -> bool:
        return self.lease is not None and self.expires > now and self.balance >= need

    def adjust(self, entry: Any, delta: int, now: float) -> None:
        """Settle a request's tokens: a debt always, a credit only into the lease they came from."""
        if delta > 0 or entry == self.lease:
            self.balance -= delta

    def returned(self, now: float) -> dict[str, Any]:
        """The lease as an exchange returns it: what is unspent now, and how long ago it last spent.

        The lease stays in use while the exchange is on its way: what it
        spends meanwhile is charged to the next lease (``settle_return``).
        """
        return {"lease": self.lease, "unused": max(0, self.balance),
                "idle": round(min(86400.0, max(0.0, now - self.last_spend)), 3) if self.spent else 0.0}

    def settle_return(self, unused: int) -> None:
        """The books took the lease back with ``unused`` units: what was spent of those since is a debt."""
        self.balance -= unused
        self.lease = None
        self.spent = False


class Slots:
    """This worker's lease of one key's concurrency slots: ``amount`` counted by the books, ``in_use`` running.

    ``in_use`` may pass ``amount`` only after the books lost our lease (a
    restart granted back fewer than were running): nothing is admitted then
    until enough requests end.
    """

    __slots__ = ("pool", "limit", "lease", "amount", "in_use", "expires", "ttl", "denied_until")

    def __init__(self, pool: tuple[str, str, str], limit: int) -> None:
        self.pool = pool
        self.limit = limit
        self.lease: str | None = None
        self.amount = 0  # slots the books count for this worker, as far as it knows
        self.in_use = 0  # requests running on them
        self.expires = 0.0  # on this worker's monotonic clock
        self.ttl = 0.0
        self.denied_until = 0.0  # the books had no slot: no ask before then

    def free(self, now: float, stale_ok: bool = False) -> bool:
        return self.lease is not None and self.in_use < self.amount and (stale_ok or self.expires > now)

    def enough(self, need: int, now: float) -> bool:
        return self.lease is not None and self.expires > now and self.amount - self.in_use >= need

    def release(self) -> None:
        self.in_use -= 1

    def keep(self) -> int:
        """Freeze the lease at the slots in use as an ask is sent: the books renew exactly those."""
        self.amount = min(self.amount, self.in_use) if self.lease is not None else 0
        return self.amount if self.lease is not None else self.in_use

    def returned(self, now: float) -> dict[str, Any]:
        unused = max(0, self.amount - self.in_use)
        self.amount -= unused  # given back: not taken while the return is on its way
        return {"lease": self.lease, "unused": unused, "idle": 0.0}

    def settle_return(self, unused: int) -> None:
        self.lease = None
        self.amount = 0

    def granted(self, answer: dict[str, Any], now: float, timeout: float) -> None:
        if "lease" in answer:
            self.lease = answer["lease"]
            self.amount = int(answer["amount"])
            self.ttl = float(answer["ttl"])
            self.expires = now + self.ttl
        else:
            self.lease, self.amount = None, 0
        wait = answer.get("retry_after")
        if "lease" not in answer or wait is not None:
            self.denied_until = now + (float(wait) if wait is not None else float(timeout))
        else:
            self.denied_until = 0.0


@dataclass
class Short:
    """Admission needs the control plane: what to ask for (pool -> (limit, span, need))."""

    asks: dict[tuple[str, str, str], tuple[int, float, int]]


class Allowance:
    """This worker's slices, the exchange with the control plane, and the background return loop."""

    def __init__(self, urls: Sequence[str], ssl_context: ssl.SSLContext | None, timeout: float = 2.0,
                 on_outage: str = "serve", clock: Any = time.monotonic) -> None:
        self.urls = [u.rstrip("/") + ALLOWANCE_PATH for u in urls]
        self.ssl_context = ssl_context
        self.timeout = timeout
        self.on_outage = on_outage
        self.clock = clock
        self.instance = secrets.token_hex(6)
        self.slices: dict[tuple[str, str, str], Slice] = {}
        self._lock = asyncio.Lock()
        self._session: aiohttp.ClientSession | None = None
        self._at = 0  # the url that answered last
        self._topping: set[tuple[str, str, str]] = set()
        self._tasks: set[asyncio.Task] = set()
        self._problem = ""
        self._down_until = 0.0  # a failed exchange: no request waits on another one before then

    # -- admission (no I/O) --------------------------------------------------

    def take(self, state: KeyState, key: str, model: str, prompt: int, completion: int, now: float,
             stale_ok: bool = False) -> Ticket | Refused | Short:
        """Spend one request's reservation from the slices held, or say what to ask the control plane for."""
        per = state.per_model.get(model)
        rules: tuple[tuple[Rule, str], ...] = ((state.rule, ""),) if per is None else ((state.rule, ""), (per, model))
        total = prompt + completion
        need = (1, prompt, completion, total, total)
        short: dict[tuple[str, str, str], tuple[int, float, int]] = {}
        denied: Refused | None = None
        for rule, scope in rules:
            if rule.concurrent is not None:
                pool = (key, scope, CONCURRENT)
                c = self.slices.get(pool)
                if not isinstance(c, Slots):
                    c = self.slices[pool] = Slots(pool, rule.concurrent)
                c.limit = rule.concurrent
                if not c.free(now, stale_ok):
                    if c.denied_until > now:  # the books said no a moment ago: a slot frees when a request ends
                        return Refused(CONCURRENT, max(1.0, c.denied_until - now), rule.concurrent,
                                       *self.views(state, key, model, now))
                    short[pool] = (rule.concurrent, 0.0, 1)
            for dim, w in rule.windows:
                n = need[dim]
                pool = (key, scope, NAMES[dim])
                s = self.slices.get(pool)
                if s is None:
                    s = self.slices[pool] = Slice(pool, w.limit, w.span)
                s.limit, s.span = w.limit, w.span
                if n > w.limit:
                    return Refused(NAMES[dim], float("inf"), w.limit)
                if s.balance >= n and s.lease is not None and (stale_ok or s.expires > now):
                    continue
                if s.denied_until > now and (denied is None or s.denied_until - now > denied.retry_after):
                    denied = Refused(NAMES[dim], s.denied_until - now, w.limit)
                short[pool] = (w.limit, w.span, n - min(0, s.balance))
        if denied is not None:
            return Refused(denied.dimension, denied.retry_after, denied.limit, *self.views(state, key, model, now))
        if short:
            return Short(short)
        entries = []
        top_up = []
        slots = []
        req = tok = None  # the slices with the least room left, for the headers
        for rule, scope in rules:
            if rule.concurrent is not None:
                c = self.slices[(key, scope, CONCURRENT)]
                c.in_use += 1
                slots.append(c)
            for dim, _w in rule.windows:
                s = self.slices[(key, scope, NAMES[dim])]
                n = need[dim]
                s.balance -= n
                if n:
                    s.last_spend, s.spent = now, True
                entries.append((s, s.lease, dim))
                if s.balance < s.granted * TOP_UP_BELOW and s.remaining > s.granted:
                    top_up.append((s.pool, n))
                if dim == REQUESTS:
                    if req is None or s.remaining + s.balance < req.remaining + req.balance:
                        req = s
                elif dim != BUDGET and (tok is None or s.remaining + s.balance < tok.remaining + tok.balance):
                    tok = s
            rule.in_flight += 1
        if top_up:
            self._top_up(top_up)
        return Ticket(key, model, prompt, completion, tuple(r for r, _ in rules), entries,
                      None if req is None else _view(req, now), None if tok is None else _view(tok, now), slots,
                      cached_weight=state.limits.cached_prompt_weight)

    def views(self, state: KeyState, key: str, model: str, now: float) -> tuple[RateView | None, RateView | None]:
        """(requests, tokens) for OpenAI's headers: the books' room as of our last grant, less what we spent since."""
        scopes = ("",) if model not in state.per_model else ("", model)
        req = tok = None
        for scope, rule in zip(scopes, (state.rule, state.per_model.get(model))):
            for dim, w in rule.windows:
                if dim == BUDGET:
                    continue
                s = self.slices.get((key, scope, NAMES[dim]))
                view = _view(s, now) if s is not None else (w.limit, w.limit, 0.0)
                if dim == REQUESTS:
                    req = view if req is None or view[1] < req[1] else req
                elif tok is None or view[1] < tok[1]:
                    tok = view
        return req, tok

    # -- the exchange ----------------------------------------------------------

    async def fetch(self, short: Short) -> None:
        """Ask for the pools of ``short`` (returning what this worker holds of them); raise ``Unavailable``."""
        if self.clock() < self._down_until:  # just failed: do not make every request wait out a timeout
            raise Unavailable(self._problem, DOWN_FOR)
        async with self._lock:
            now = self.clock()
            if now < self._down_until:
                raise Unavailable(self._problem, DOWN_FOR)
            asks = []
            for pool, (limit, span, need) in short.asks.items():
                s = self.slices.get(pool)
                if s is not None and s.enough(need, now):
                    continue  # an exchange while we waited for the lock brought enough
                asks.append((pool, limit, span, need))
            if asks:
                await self._exchange(asks, now)

    async def _exchange(self, asks: list[tuple[tuple[str, str, str], int, float, int]], now: float,
                        everything: bool = False, give_back: Sequence[Any] = ()) -> None:
        """One POST: return the asked pools' leases and every ended lease, then apply the answers.

        A returned lease is spent from until the answer comes (a request
        does not wait for a top-up); the books free what was unspent when
        the exchange was sent, so what was spent of that since is charged
        to the new lease, or kept as a debt when none is granted.  An
        exchange that fails changes nothing here.
        """
        returns, sent = [], []
        asked = {a[0] for a in asks}
        for pool, s in self.slices.items():
            if isinstance(s, Slots) and pool in asked:
                continue  # renewed by the ask, not returned
            if s.lease is not None and (everything or pool in asked or s.expires <= now or s in give_back):
                r = s.returned(now)
                returns.append(r)
                sent.append((s, r["unused"]))
        wire = []
        for p, limit, span, need in asks:
            ask = {"key": p[0], "scope": p[1], "dimension": p[2], "limit": limit, "span": span, "need": max(0, need)}
            c = self.slices.get(p)
            if isinstance(c, Slots):
                ask["held"] = c.keep()
            wire.append(ask)
        body = {"instance": self.instance, "returns": returns, "asks": wire}
        doc = await self._post(body)
        for s, unused in sent:
            s.settle_return(unused)
        for (pool, limit, span, _need), answer in zip(asks, doc.get("answers", ())):
            s = self.slices.get(pool) or self.slices.setdefault(pool, Slice(pool, limit, span))
            if isinstance(s, Slots):
                s.granted(answer, now, self.timeout)
                continue
            if "lease" in answer:
                s.lease = answer["lease"]
                s.balance += int(answer["amount"])
                s.granted = int(answer["amount"])
                s.expires = now + float(answer["ttl"])
                s.remaining = int(answer["remaining"])
                s.reset_at = now + float(answer["reset"])
                s.denied_until = 0.0
            else:
                wait = answer.get("retry_after")
                s.denied_until = now + (float(wait) if wait is not None else float(self.timeout))
                s.remaining = 0
                s.reset_at = now + float(answer.get("reset", 0.0))

    async def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                connector=aiohttp.TCPConnector(limit=2, ssl=self.ssl_context if self.ssl_context is not None else True))
        problem, retry = "", 1.0
        for i in range(len(self.urls)):
            url = self.urls[(self._at + i) % len(self.urls)]
            try:
                async with self._session.post(url, json=body, allow_redirects=False) as r:
                    if r.status == 200:
                        doc = await r.json()
                        self._at = (self._at + i) % len(self.urls)
                        if self._problem:
                            log.info("allowance exchange with %s works again", url)
                            self._problem = ""
                        return doc
                    text = (await r.content.read(300)).decode("utf-8", "replace")
                    problem = f"HTTP {r.status} from {url}: {text}"
                    if r.status == 503:
                        retry = float(r.headers.get("Retry-After", "1") or 1)
            except asyncio.CancelledError:
                raise
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as e:
                problem = f"{type(e).__name__} from {url}: {e}"
        self._down_until = self.clock() + DOWN_FOR
        if problem != self._problem:
            log.warning("allowance exchange failed: %s; on_outage: %s", problem, self.on_outage)
            self._problem = problem
        raise Unavailable(problem, retry)

    # -- background --------------------------------------------------------------

    def _top_up(self, pools: list[tuple[tuple[str, str, str], int]]) -> None:
        pools = [(p, n) for p, n in pools if p not in self._topping]
        if not pools:
            return
        for p, _ in pools:
            self._topping.add(p)

        async def run() -> None:
            try:
                async with self._lock:
                    now = self.clock()
                    asks = [(p, self.slices[p].limit, self.slices[p].span, max(1, n) - min(0, self.slices[p].balance))
                            for p, n in pools]
                    await self._exchange(asks, now)
            except Unavailable:
                pass
            finally:
                for p, _ in pools:
                    self._topping.discard(p)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def run_returns(self) -> None:
        """Return slices whose lease ended and renew concurrency slots, for as long as the worker runs.

        Every slice goes back when it stops.  Concurrency leases are looked
        at every quarter of their lease at least, so that one with requests
        running is renewed before it ends.
        """
        try:
            while True:
                ttls = [s.ttl for s in self.slices.values() if isinstance(s, Slots) and s.lease is not None]
                await asyncio.sleep(min([RETURN_EVERY, *(t / 4 for t in ttls if t > 0)]))
                now = self.clock()
                renew, back = self.due(now)
                if renew or back or any(s.lease is not None and s.expires <= now for s in self.slices.values()):
                    async with self._lock:
                        now = self.clock()
                        renew, back = self.due(now)  # what an exchange made while we waited changed
                        try:
                            await self._exchange([(s.pool, s.limit, 0.0, 0) for s in renew], now, give_back=back)
                        except Unavailable:
                            pass
        except asyncio.CancelledError:
            await self.close()
            raise

    def due(self, now: float) -> tuple[list[Slots], list[Slots]]:
        """Concurrency leases past half their time: (to renew, requests running; to give back, none running)."""
        renew, back = [], []
        for s in self.slices.values():
            if isinstance(s, Slots) and s.lease is not None and s.expires - now < s.ttl / 2:
                (renew if s.in_use > 0 else back).append(s)
        return renew, back

    async def close(self) -> None:
        """Give every slice back (a worker restarting strands nothing for a window), then close the session."""
        try:
            if any(s.lease is not None for s in self.slices.values()):
                async def give_back() -> None:
                    async with self._lock:
                        await self._exchange([], self.clock(), everything=True)
                task = asyncio.ensure_future(give_back())
                done, _ = await asyncio.wait({task}, timeout=self.timeout)  # never wait_for here: a cancellation must not become a timeout
                if not done:
                    task.cancel()
                with contextlib.suppress(Unavailable, asyncio.CancelledError):
                    await task
        finally:
            if self._session is not None:
                await self._session.close()
                self._session = None


def _view(s: Slice, now: float) -> RateView:
    """(limit, remaining, reset seconds) of a pool as this worker sees it."""
    return (s.limit, max(0, s.remaining + max(0, s.balance)), max(0.0, s.reset_at - now))
