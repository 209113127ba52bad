"""Per-key limits: sliding windows, reservations on admission, settlement from real usage.

Pure bookkeeping on a clock the caller passes in (the router's monotonic
clock; tests pass a fake one); no I/O.  ``limitsgate.py`` wires it into the
request path.

Why it is shaped this way (the ways gateways get it wrong):

* **One window per dimension.**  Requests, input tokens, output tokens,
  total tokens and the day's budget each have their own window and their
  own count.  A key refused for tokens has spent no request, and a refusal
  never extends a window: nothing is counted for a request that is refused.
* **Sliding, in slots.**  A window of ``span`` seconds is kept as ``slots``
  sub-buckets (a minute in 60 one-second slots, a day in 1440 one-minute
  slots).  A slot stops counting once the whole of it is more than ``span``
  old, so at no instant does the window hold less than the last ``span``
  seconds: a limit is never exceeded, and a key is never held past its
  window by more than one slot.  ``Retry-After`` is the time until enough
  slots have aged out for the refused request to fit.
* **Reserve, then settle.**  Tokens are unknown until the engine answers.
  Admission reserves the estimated prompt and ``max_tokens`` (or the key's
  ``default_max_tokens``) in every token window, so concurrent requests
  cannot together pass a limit that each alone would not; settlement
  replaces the reservation with the engine's ``usage`` in the slot where it
  was reserved.  A request whose reservation alone is larger than a limit
  can never be admitted: it is refused as too large, not made to wait.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Iterable

from .settings import ApiKey, KeyLimits, KeyRates

__all__ = ["Window", "Rule", "Limiter", "Ticket", "Refused", "RateView", "DAY"]

DAY = 86400.0
_MINUTE_SLOTS = 60
_DAY_SLOTS = 1440

# the dimensions of a window, in the order they are checked
REQUESTS, INPUT, OUTPUT, TOTAL, BUDGET = "requests", "input_tokens", "output_tokens", "tokens", "tokens_per_day"


class Window:
    """A sliding count over ``span`` seconds in ``slots`` slots; ``limit`` is what it may hold."""

    __slots__ = ("limit", "span", "slot_len", "slots", "_q", "used")

    def __init__(self, limit: int, span: float, slots: int) -> None:
        self.limit = limit
        self.span = span
        self.slots = slots
        self.slot_len = span / slots
        self._q: deque[list] = deque()  # [slot index, amount], oldest first, one entry per slot used
        self.used = 0

    def _expire(self, now: float) -> int:
        cur = int(now // self.slot_len)
        q = self._q
        horizon = cur - self.slots  # a slot at or below this ended more than ``span`` ago
        while q and q[0][0] < horizon:
            self.used -= q.popleft()[1]
        return cur

    def room(self, now: float) -> int:
        self._expire(now)
        return self.limit - self.used

    def wait(self, need: int, now: float) -> float:
        """Seconds until ``need`` fits, if nothing else is added; ``inf`` if it never can."""
        if need > self.limit:
            return math.inf
        self._expire(now)
        excess = self.used + need - self.limit
        if excess <= 0:
            return 0.0
        for idx, amount in self._q:
            excess -= amount
            if excess <= 0:
                return max(0.0, (idx + self.slots + 1) * self.slot_len - now)
        return self.span  # reservations already settled to less: at most a window  # pragma: no cover

    def reset_in(self, now: float) -> float:
        """Seconds until the window is empty again (OpenAI's ``x-ratelimit-reset-*``)."""
        self._expire(now)
        if not self._q:
            return 0.0
        return max(0.0, (self._q[-1][0] + self.slots + 1) * self.slot_len - now)

    def add(self, amount: int, now: float) -> list:
        """Count ``amount`` now; the slot it went to, for ``adjust``."""
        cur = self._expire(now)
        q = self._q
        self.used += amount
        if q and q[-1][0] == cur:
            q[-1][1] += amount
            return q[-1]
        entry = [cur, amount]
        q.append(entry)
        return entry

    def adjust(self, entry: list, delta: int, now: float) -> None:
        """Correct what was counted in ``entry``'s slot, unless the slot has already aged out."""
        cur = self._expire(now)
        if entry[0] >= cur - self.slots:
            entry[1] += delta
            self.used += delta


class Rule:
    """The windows and concurrency of one key (or one key on one model)."""

    __slots__ = ("windows", "concurrent", "in_flight")

    def __init__(self, rates: KeyRates, window_seconds: float) -> None:
        w: list[tuple[str, Window]] = []
        for dim, limit, span, slots in (
                (REQUESTS, rates.requests_per_minute, window_seconds, _MINUTE_SLOTS),
                (INPUT, rates.input_tokens_per_minute, window_seconds, _MINUTE_SLOTS),
                (OUTPUT, rates.output_tokens_per_minute, window_seconds, _MINUTE_SLOTS),
                (TOTAL, rates.tokens_per_minute, window_seconds, _MINUTE_SLOTS),
                (BUDGET, rates.tokens_per_day, DAY, _DAY_SLOTS)):
            if limit is not None:
                w.append((dim, Window(limit, span, slots)))
        self.windows = tuple(w)
        self.concurrent = rates.concurrent_requests
        self.in_flight = 0

    def window(self, dim: str) -> Window | None:
        for d, w in self.windows:
            if d == dim:
                return w
        return None


def amounts(prompt: int, completion: int) -> dict[str, int]:
    """What one request counts in each dimension."""
    return {REQUESTS: 1, INPUT: prompt, OUTPUT: completion, TOTAL: prompt + completion,
            BUDGET: prompt + completion}


@dataclass
class Ticket:
    """An admitted request's reservations, given back (settled) exactly once."""

    key: str
    model: str
    prompt: int  # reserved
    completion: int  # reserved
    rules: tuple[Rule, ...]
    entries: list  # (window, slot entry, dimension)
    settled: bool = False


@dataclass(frozen=True)
class Refused:
    dimension: str  # which limit refused (the longest wait among those that did)
    retry_after: float  # seconds; inf: the request can never fit (larger than the limit)
    limit: int


@dataclass(frozen=True)
class RateView:
    """What OpenAI's ``x-ratelimit-*`` headers show for one dimension."""

    limit: int
    remaining: int
    reset: float


class KeyState:
    __slots__ = ("limits", "rule", "per_model")

    def __init__(self, limits: KeyLimits) -> None:
        self.limits = limits
        self.rule = Rule(limits.rates, limits.window_seconds)
        self.per_model = {m: Rule(r, limits.window_seconds) for m, r in limits.per_model.items()}


class Limiter:
    """Every limited key of one router worker, by key name."""

    def __init__(self, keys: Iterable[ApiKey]) -> None:
        self.keys: dict[str, KeyState] = {k.name: KeyState(k.limits) for k in keys if k.limits is not None}

    def state(self, key: str) -> KeyState | None:
        return self.keys.get(key)

    def admit(self, state: KeyState, key: str, model: str, prompt: int, completion: int,
              now: float) -> Ticket | Refused:
        """Reserve ``prompt`` + ``completion`` tokens and one request in every window, or refuse and count nothing."""
        rules = (state.rule,) if (m := state.per_model.get(model)) is None else (state.rule, m)
        need = amounts(prompt, completion)
        worst: Refused | None = None
        for rule in rules:
            if rule.concurrent is not None and rule.in_flight >= rule.concurrent:
                # ends when a request ends, not with a window: a second is a fair first retry
                worst = _worse(worst, Refused("concurrent_requests", 1.0, rule.concurrent))
            for dim, w in rule.windows:
                wait = w.wait(need[dim], now)
                if wait > 0:
                    worst = _worse(worst, Refused(dim, wait, w.limit))
        if worst is not None:
            return worst
        entries = []
        for rule in rules:
            rule.in_flight += 1
            for dim, w in rule.windows:
                entries.append((w, w.add(need[dim], now), dim))
        return Ticket(key, model, prompt, completion, rules, entries)

    def settle(self, ticket: Ticket, prompt: int, completion: int, now: float) -> None:
        """Replace the ticket's reservations with what the request used; a second call does nothing."""
        if ticket.settled:
            return
        ticket.settled = True
        reserved = amounts(ticket.prompt, ticket.completion)
        used = amounts(prompt, completion)
        for w, entry, dim in ticket.entries:
            delta = used[dim] - reserved[dim]
            if delta:
                w.adjust(entry, delta, now)
        for rule in ticket.rules:
            rule.in_flight -= 1

    def views(self, state: KeyState, model: str, now: float) -> tuple[RateView | None, RateView | None]:
        """(requests, tokens) as OpenAI's headers show them: the tightest window of each kind."""
        rules = (state.rule,) if (m := state.per_model.get(model)) is None else (state.rule, m)
        req: RateView | None = None
        tok: RateView | None = None
        for rule in rules:
            for dim, w in rule.windows:
                view = RateView(w.limit, max(0, w.room(now)), w.reset_in(now))
                if dim == REQUESTS:
                    req = _tighter(req, view)
                elif dim != BUDGET:
                    tok = _tighter(tok, view)
        return req, tok


def _worse(a: Refused | None, b: Refused) -> Refused:
    return b if a is None or b.retry_after > a.retry_after else a


def _tighter(a: RateView | None, b: RateView) -> RateView:
    return b if a is None or b.remaining < a.remaining else a
