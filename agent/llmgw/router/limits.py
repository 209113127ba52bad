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

__all__ = ["Window", "Rule", "Limiter", "Ticket", "Refused", "RateView", "DAY", "NAMES"]

DAY = 86400.0
_MINUTE_SLOTS = 60
_DAY_SLOTS = 1440

# the dimensions, indexes into what a request counts in each (``Limiter.admit``'s ``need``)
REQUESTS, INPUT, OUTPUT, TOTAL, BUDGET = range(5)
NAMES = ("requests", "input_tokens", "output_tokens", "tokens", "tokens_per_day")


class Window:
    """A sliding count over ``span`` seconds in ``slots`` slots; ``limit`` is what it may hold.

    ``expire(now)`` first, then the ``*_now`` methods read the window as of that
    instant (one clock division per window per request on the hot path).
    """

    __slots__ = ("limit", "span", "slot_len", "slots", "_q", "used", "cur")

    def __init__(self, limit: int, span: float, slots: int) -> None:
        self.limit = limit
        self.span = span
        self.slots = slots
        self.slot_len = span / slots
        self._q: deque[list] = deque()  # [slot index, amount], oldest first, one entry per slot used
        self.used = 0
        self.cur = -1  # the slot of the last ``expire``

    def expire(self, now: float) -> None:
        cur = int(now // self.slot_len)
        if cur == self.cur:
            return  # slots age out only when a new one begins
        self.cur = cur
        q = self._q
        horizon = cur - self.slots  # a slot below this ended more than ``span`` ago
        while q and q[0][0] < horizon:
            self.used -= q.popleft()[1]

    def wait_now(self, need: int, now: float) -> float:
        """Seconds until ``need`` fits, if nothing else is added; ``inf`` if it never can."""
        if need > self.limit:
            return math.inf
        excess = self.used + need - self.limit
        if excess <= 0:
            return 0.0
        for idx, amount in self._q:
            excess -= amount
            if excess <= 0:
                return max(0.0, (idx + self.slots + 1) * self.slot_len - now)
        return self.span  # pragma: no cover - what is counted is in the slots

    def reset_now(self, now: float) -> float:
        """Seconds until the window is empty again (OpenAI's ``x-ratelimit-reset-*``)."""
        q = self._q
        if not q:
            return 0.0
        return max(0.0, (q[-1][0] + self.slots + 1) * self.slot_len - now)

    def add_now(self, amount: int) -> list:
        """Count ``amount`` in the current slot; the slot's entry, for ``adjust``."""
        q = self._q
        self.used += amount
        if q:
            last = q[-1]
            if last[0] == self.cur:
                last[1] += amount
                return last
        entry = [self.cur, amount]
        q.append(entry)
        return entry

    def undo(self, entry: list, amount: int) -> None:
        """Take back an ``add_now`` of this instant (a request refused by another window)."""
        entry[1] -= amount
        self.used -= amount
        q = self._q
        if not entry[1] and q and q[-1] is entry:
            q.pop()

    # the same, each with its own ``expire`` (tests, and paths off the hot one)
    def wait(self, need: int, now: float) -> float:
        self.expire(now)
        return self.wait_now(need, now)

    def add(self, amount: int, now: float) -> list:
        self.expire(now)
        return self.add_now(amount)

    def room(self, now: float) -> int:
        self.expire(now)
        return self.limit - self.used

    def adjust(self, entry: list, delta: int, now: float) -> None:
        """Correct what was counted in ``entry``'s slot, unless the slot has already aged out."""
        if now // self.slot_len != self.cur:
            self.expire(now)
        if entry[0] >= self.cur - self.slots:
            entry[1] += delta
            self.used += delta


class Rule:
    """The windows and concurrency of one key (or one key on one model)."""

    __slots__ = ("windows", "concurrent", "in_flight")

    def __init__(self, rates: KeyRates, window_seconds: float) -> None:
        w: list[tuple[int, Window]] = []
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


# (limit, remaining, reset seconds) of one window, as OpenAI's x-ratelimit-* headers show it
RateView = tuple


class Ticket:
    """An admitted request's reservations, given back (settled) exactly once."""

    __slots__ = ("key", "model", "prompt", "completion", "rules", "entries", "requests", "tokens", "settled",
                 "slots", "cached_weight")

    def __init__(self, key: str, model: str, prompt: int, completion: int, rules: tuple[Rule, ...],
                 entries: list, requests: RateView | None, tokens: RateView | None, slots: list = (),
                 cached_weight: float = 1.0) -> None:
        self.key = key
        self.model = model
        self.prompt = prompt  # reserved
        self.completion = completion  # reserved
        self.rules = rules
        self.entries = entries  # (window, slot entry, dimension)
        self.requests = requests  # the tightest requests window after this reservation
        self.tokens = tokens  # the tightest minute token window after it
        self.settled = False
        self.slots = slots  # concurrency slots leased across routers (allowance.Slots), held until settled
        self.cached_weight = cached_weight  # what a cached prompt token counts when settled (KeyLimits.cached_prompt_weight)


@dataclass(frozen=True)
class Refused:
    dimension: str  # which limit refused (the longest wait among those that did)
    retry_after: float  # seconds; inf: the request can never fit (larger than the limit)
    limit: int
    requests: RateView | None = None
    tokens: RateView | None = None


class KeyState:
    __slots__ = ("limits", "rule", "per_model")

    def __init__(self, limits: KeyLimits) -> None:
        self.limits = limits
        self.rule = Rule(limits.rates, limits.window_seconds)
        self.per_model = {m: Rule(r, limits.window_seconds) for m, r in limits.per_model.items()}


class Limiter:
    """Every limited key of one router worker, by key name."""

    def __init__(self, keys: Iterable[ApiKey]) -> None:
        self.keys: dict[str, KeyState] = {}
        self.replace(keys)

    def replace(self, keys: Iterable[ApiKey]) -> None:
        """Put reloaded keys in force. A key whose limits did not change keeps its windows (a reload
        neither forgives nor re-counts what it used); a changed one starts afresh. Requests in flight
        settle into the books they were admitted by."""
        old = self.keys
        new: dict[str, KeyState] = {}
        for k in keys:
            if k.limits is None:
                continue
            kept = old.get(k.name)
            new[k.name] = kept if kept is not None and kept.limits == k.limits else KeyState(k.limits)
        self.keys = new

    def admit(self, state: KeyState, key: str, model: str, prompt: int, completion: int,
              now: float) -> Ticket | Refused:
        """Reserve ``prompt`` + ``completion`` tokens and one request in every window, or refuse and count nothing.

        One pass: each window that has room counts the request at once; if any
        window refuses, what was counted is taken back (refusals are the rare case).
        """
        rules = (state.rule,) if (m := state.per_model.get(model)) is None else (state.rule, m)
        total = prompt + completion
        need = (1, prompt, completion, total, total)
        worst: Refused | None = None
        entries = []
        req = tok = None  # the windows with the least room left once counted, for the headers
        req_room = tok_room = 0
        for rule in rules:
            if rule.concurrent is not None and rule.in_flight >= rule.concurrent:
                # ends when a request ends, not with a window: a second is a fair first retry
                worst = _worse(worst, Refused("concurrent_requests", 1.0, rule.concurrent))
            for dim, w in rule.windows:
                if now // w.slot_len != w.cur:  # a float's floor against the int slot: exact, no int()
                    w.expire(now)
                n = need[dim]
                room = w.limit - w.used - n  # what is left once this request is counted
                if room < 0:
                    worst = _worse(worst, Refused(NAMES[dim], w.wait_now(n, now), w.limit))
                    continue
                entries.append((w, w.add_now(n), dim))
                if dim == REQUESTS:
                    if req is None or room < req_room:
                        req, req_room = w, room
                elif dim != BUDGET and (tok is None or room < tok_room):
                    tok, tok_room = w, room
        if worst is not None:
            for w, entry, dim in reversed(entries):
                w.undo(entry, need[dim])
            rv, tv = self.views(state, model, now)
            return Refused(worst.dimension, worst.retry_after, worst.limit, rv, tv)
        for rule in rules:
            rule.in_flight += 1
        return Ticket(key, model, prompt, completion, rules, entries,
                      None if req is None else (req.limit, req_room, req.reset_now(now)),
                      None if tok is None else (tok.limit, tok_room, tok.reset_now(now)),
                      cached_weight=state.limits.cached_prompt_weight)

    def settle(self, ticket: Ticket, prompt: int, completion: int, now: float, cached: int = 0) -> None:
        """Replace the ticket's reservations with what the request used; a second call does nothing.

        ``cached`` of the ``prompt`` tokens were in the engine's prefix cache: each counts
        ``cached_weight`` of a token in the token windows."""
        if ticket.settled:
            return
        ticket.settled = True
        if cached > 0 and ticket.cached_weight < 1.0:
            prompt -= round(min(cached, prompt) * (1.0 - ticket.cached_weight))
        dp = prompt - ticket.prompt
        dc = completion - ticket.completion
        if dp or dc:  # what was used, less what was reserved, in each dimension (REQUESTS, INPUT, ...)
            delta = (0, dp, dc, dp + dc, dp + dc)
            for w, entry, dim in ticket.entries:
                d = delta[dim]
                if d:
                    w.adjust(entry, d, now)
        for rule in ticket.rules:
            rule.in_flight -= 1
        for slots in ticket.slots:
            slots.release()

    def views(self, state: KeyState, model: str, now: float) -> tuple[RateView | None, RateView | None]:
        """(requests, tokens) as OpenAI's headers show them: the tightest window of each kind."""
        rules = (state.rule,) if (m := state.per_model.get(model)) is None else (state.rule, m)
        req = tok = None
        for rule in rules:
            for dim, w in rule.windows:
                w.expire(now)
                if dim == REQUESTS:
                    req = _tighter(req, w, now)
                elif dim != BUDGET:
                    tok = _tighter(tok, w, now)
        return req, tok


def _worse(a: Refused | None, b: Refused) -> Refused:
    return b if a is None or b.retry_after > a.retry_after else a


def _tighter(a: RateView | None, w: Window, now: float) -> RateView:
    """``a`` or ``w``'s view (``w`` already expired to ``now``), whichever has less room left."""
    remaining = w.limit - w.used
    if a is not None and a[1] <= remaining:
        return a
    return (w.limit, max(0, remaining), w.reset_now(now))
