"""Who gets the GPUs when autoscaled deployments want more than the fleet budget: priorities, pure.

Each autoscaled deployment's scaler (``autoscale.Scaler``) decides the count
its own demand asks for; on a fixed pool (server.yaml ``autoscale_budget``)
those counts can add up to more GPUs than there are.  Placement alone would
then hand the GPUs to whichever deployment the reconciler reaches first; this
decides instead, every pass, by the rule:

1. every deployment keeps its ``min`` (never below: the mins are validated to
   fit the pool, ``settings._budget_errors``);
2. the GPUs left go to the highest ``priority`` first, then the next, each
   deployment up to its desired count;
3. deployments of equal priority that do not all fit share what is left in
   proportion to their demand above ``min`` (in GPUs), rounded down to whole
   replicas; the GPUs the rounding leaves go one replica at a time to the
   largest remainder (ties: the deployment key), while a replica fits;
4. GPUs a tier cannot use (a replica too big for what is left) go on to the
   next tier down.

The granted count is the count the reconciler places.  A deployment cut below
what runs is scaled down the ordinary way: the reconciler drains its highest
slots (they leave the routers, finish their requests, then stop) and the
winner's new replicas are placed when the GPUs are free: make before break.

Damping: a grant may always fall (the pool must hold, or the winner waits
forever), but after a cut (a fall that left it below its desired count) a
grant that would rise again within ``scale_down_cooldown`` of the last change
of direction is held: at most one reversal per cooldown, as for the scaler
itself, so a winner whose demand swings cannot make a loser load and unload a
model in turn.  Moves that follow a deployment's own desired count are its
scaler's, already damped there, and are not held again.

No clock and no I/O: ``Budget.grant`` takes ``now``; the control plane's
autoscaler calls it after its scalers (``controlplane/autoscaler.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from llmgw.catalog import Deployment

# The reason label of llmgw_autoscale_granted_replicas (besides the scaler's reasons).
FULL = "full"  # granted everything the scaler asked for
PRIORITY = "priority"  # cut: higher-priority deployments hold the GPUs
SHARE = "share"  # cut: equal priorities share what is left in proportion to demand
POOL = "pool"  # cut: alone in the pool, it wants more than the budget holds
REVERSAL = "budget-reversal"  # a rise held: at most one reversal per cooldown
OVER = "over-budget"  # the mins alone need more than the pool (a reload that shrank it)
REASONS = (FULL, PRIORITY, SHARE, POOL, REVERSAL, OVER)


@dataclass(frozen=True)
class Claim:
    """One autoscaled deployment's demand on the pool this pass."""

    key: str
    desired: int  # what its scaler decided (already within min..max)
    min: int
    priority: int = 0
    gpus: int = 1  # per replica
    cooldown: float = 300.0  # its scale_down_cooldown: the reversal damping's period


@dataclass(frozen=True)
class Grant:
    key: str
    desired: int
    granted: int
    reason: str = FULL
    winners: tuple[str, ...] = ()  # PRIORITY: who holds the GPUs ("priority 10 deployment X")
    peers: tuple[str, ...] = ()  # SHARE: the equal-priority deployments it shares with
    pool: int = 0

    def explain(self) -> str:
        """The budget's part of ``ctl explain``'s autoscale line: granted vs desired and why."""
        head = f"budget {self.pool} GPU(s): granted {self.granted} of {self.desired}"
        if self.reason == FULL:
            return head
        if self.reason == PRIORITY:
            why = "; ".join(f"{w} holds the GPUs" for w in self.winners)
            if self.peers:
                why += f"; shares the rest with {', '.join(self.peers)} in proportion to demand"
        elif self.reason == SHARE:
            why = f"shares the GPUs left with {', '.join(self.peers)} in proportion to demand"
        elif self.reason == POOL:
            why = "the budget holds no more"
        elif self.reason == REVERSAL:
            why = "held: at most one reversal per cooldown"
        else:
            why = "the autoscaled deployments' mins alone need more GPUs than the budget"
        return f"{head} ({self.reason}: {why})"


def arbitrate(claims: Iterable[Claim], pool: int) -> dict[str, Grant]:
    """The rule (module docstring), without damping: each claim's granted count and why."""
    claims = sorted(claims, key=lambda c: c.key)
    granted = {c.key: c.min for c in claims}
    left = pool - sum(c.min * c.gpus for c in claims)
    if left < 0:
        return {c.key: Grant(c.key, c.desired, c.min, FULL if c.desired <= c.min else OVER, pool=pool)
                for c in claims}
    reasons: dict[str, Grant] = {}
    holders: list[Claim] = []  # higher tiers' deployments granted above their min
    for prio in sorted({c.priority for c in claims}, reverse=True):
        tier = [c for c in claims if c.priority == prio and c.desired > c.min]
        need = sum((c.desired - c.min) * c.gpus for c in tier)
        if need <= left:
            for c in tier:
                granted[c.key] = c.desired
            left -= need
        else:
            left = _share(tier, granted, left, need)
        holders += [c for c in tier if granted[c.key] > c.min]
    for c in claims:
        g = granted[c.key]
        if g >= c.desired:
            reasons[c.key] = Grant(c.key, c.desired, g, pool=pool)
            continue
        above = tuple(f"priority {h.priority} deployment {h.key}" for h in holders if h.priority > c.priority)
        peers = tuple(p.key for p in claims if p.priority == c.priority and p.key != c.key and p.desired > p.min)
        reason = PRIORITY if above else (SHARE if peers else POOL)
        reasons[c.key] = Grant(c.key, c.desired, g, reason, above, peers, pool)
    return reasons


def _share(tier: list[Claim], granted: dict[str, int], left: int, need: int) -> int:
    """Split ``left`` GPUs over ``tier`` in proportion to each one's demand above min; the GPUs left over."""
    share = {c.key: left * (c.desired - c.min) * c.gpus / need for c in tier}
    extra = {c.key: min(c.desired - c.min, math.floor(share[c.key] / c.gpus + 1e-9)) for c in tier}
    left -= sum(extra[c.key] * c.gpus for c in tier)
    while True:
        fits = [c for c in tier if extra[c.key] < c.desired - c.min and c.gpus <= left]
        if not fits:
            break
        c = min(fits, key=lambda c: (-(share[c.key] / c.gpus - extra[c.key]), c.key))
        extra[c.key] += 1
        left -= c.gpus
    for c in tier:
        granted[c.key] = c.min + extra[c.key]
    return left


@dataclass
class _Track:
    granted: int
    direction: int = 0
    reversal_at: float | None = None
    cut: bool = False  # the last move left it below its desired count: the budget's doing, not its demand's


@dataclass
class Budget:
    """The rule plus its damping state across passes (one per control plane)."""

    tracks: dict[str, _Track] = field(default_factory=dict)

    def grant(self, claims: Iterable[Claim], pool: int, now: float) -> dict[str, Grant]:
        claims = list(claims)
        out = arbitrate(claims, pool)
        for c in claims:
            g = out[c.key]
            t = self.tracks.get(c.key)
            if t is None:
                self.tracks[c.key] = _Track(g.granted)
                continue
            moved = (g.granted > t.granted) - (g.granted < t.granted)
            if (moved > 0 and t.direction < 0 and t.cut and t.reversal_at is not None
                    and now - t.reversal_at < c.cooldown):
                # a rise after a cut within a cooldown of the last reversal: hold (falling is always allowed),
                # though never below a min a reload raised
                if t.granted >= c.min:
                    out[c.key] = Grant(c.key, c.desired, t.granted, REVERSAL, pool=pool)
                    continue
            if moved:
                if t.direction and moved != t.direction:
                    t.reversal_at = now
                t.direction, t.granted = moved, g.granted
                t.cut = g.granted < g.desired
        for key in set(self.tracks) - {c.key for c in claims}:
            del self.tracks[key]
        return out


def claims_of(deployments: Iterable[Deployment], desired: Mapping[str, int], gpus: Mapping[str, int]) -> list[Claim]:
    """The claims of the autoscaled ``deployments`` given their scalers' counts and GPUs per replica by profile."""
    return [Claim(d.key, desired[d.key], d.autoscale.min, d.autoscale.priority, gpus.get(d.profile, 1),
                  d.autoscale.scale_down_cooldown)
            for d in deployments if d.autoscale is not None and d.key in desired]
