"""The replay: a fixed GPU pool serving a trace, in simulated time, with the real autoscale rule.

A discrete-event simulation: no processes, no sleeps, the clock jumps from event to event.
What it models, and what it leaves out:

- **Replicas.** One GPU each.  A placed replica *starts* for ``lead`` seconds (fetch and
  load; it holds its GPU and serves nothing), then is *ready*.  A surplus replica *drains*:
  it takes no new request, finishes those it runs, then stops and frees its GPU.  A
  replica still starting when it becomes surplus serves nothing, so it stops at once.
- **Service time**, the engine simulator's timing model (``sim/sim_timing.py``): a request
  admitted into a batch of ``b`` running requests has its first token after
  ``prefill x input_length + itl(b)`` and its last after ``prefill x input_length +
  output_length x itl(b)``, with ``itl(b) = token x (1 + slowdown x (b - 1))``.  ``b`` is the
  batch when it is admitted, held for its whole decode (the simulator recomputes it per
  token; this keeps one event per request).  As in the simulator, prefills do not wait on
  each other; a replica admits at most ``max_batch`` requests.
- **Queueing and routing.** Each model has one queue (the router's view: requests in flight
  not yet running); a request goes to the ready, non-draining replica running the fewest,
  as the router's least-outstanding balance does.  TTFT = queue wait + prefill + one step.
- **The rule.** Every ``tick`` (1 s: a control-plane pass) each model's scaler
  (``llmgw.controlplane.autoscale.Scaler``, unchanged) observes the model's *outstanding*
  requests (queued + running on any of its replicas, draining ones included: what the
  router counts) and, once a whole stable window has been measured (the control plane's
  startup grace: the first sample, taken before any request arrived, would otherwise be
  all the rule had and scale the opening count down to ``min``), decides; the count is then reconciled: new replicas are placed while
  the pool has free GPUs (a shortfall is retried every pass and counted as unplaced
  replica-seconds), surplus ones drained newest first.  With ``fixed`` counts instead of
  a policy, the replicas are there, ready, from the start: static provisioning.
- **The pool.** ``pool`` GPUs shared by the models, arbitrated as the control plane does
  with ``autoscale_budget`` set to it: each pass the scalers' counts go through the real
  ``controlplane/autoscale_budget.Budget`` (mins first, then priority, equal priorities
  sharing in proportion to demand, its own reversal damping), and the *granted* count is
  the one reconciled.  A cut model drains; the winner's new replicas wait for the GPUs
  to free (make before break), counted as unplaced replica-seconds meanwhile.

GPU-hours are each replica's time from placement to stop (starting and draining included).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

from llmgw.catalog import Autoscale
from llmgw.controlplane.autoscale import Scaler
from llmgw.controlplane.autoscale_budget import Budget, Claim
from llmgw.sim.sim_timing import PRESETS, inter_token

_KNOBS = PRESETS["vllm-cpu-tiny"].knobs


@dataclass(frozen=True)
class Engine:
    """Service-time constants; the defaults are the simulator's ``vllm-cpu-tiny`` preset
    (benchmarks/results/simfit.md) and a batch cap of 16."""

    prefill: float = float(_KNOBS["LLMGW_SIM_PREFILL_TOKEN_LATENCY"])  # s per prompt token
    token: float = float(_KNOBS["LLMGW_SIM_TOKEN_LATENCY"])  # s per output token, alone
    slowdown: float = float(_KNOBS["LLMGW_SIM_DECODE_BATCH_SLOWDOWN"])  # per other running request
    max_batch: int = 16


class Replica:
    __slots__ = ("model", "placed_at", "ready_at", "stopped_at", "running", "draining")

    def __init__(self, model: str, placed_at: float, ready_at: float):
        self.model, self.placed_at, self.ready_at = model, placed_at, ready_at
        self.stopped_at: float | None = None
        self.running = 0
        self.draining = False


@dataclass
class ModelRun:
    """One model's outcome: every request's arrival and TTFT, the count decided each pass."""

    name: str
    arrivals: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    decisions: list[tuple[float, int, str]] = field(default_factory=list)  # (t, desired, reason) on change
    gpu_seconds: float = 0.0
    peak_replicas: int = 0  # most replicas placed at once
    cut_seconds: float = 0.0  # replica-seconds its scaler wanted beyond what the budget granted
    unplaced_seconds: float = 0.0  # replica-seconds granted but not yet placed: GPUs still draining
    max_queue: int = 0


@dataclass
class Result:
    models: dict[str, ModelRun]
    duration: float
    pool: int
    peak_placed: int = 0  # most GPUs held at once, all models together

    @property
    def gpu_hours(self) -> float:
        return sum(m.gpu_seconds for m in self.models.values()) / 3600.0


def replay(trace: list[dict], duration: float, pool: int, engine: Engine, lead: float,
           policies: dict[str, Autoscale] | None = None, fixed: dict[str, int] | None = None,
           start: dict[str, int] | None = None, priorities: dict[str, int] | None = None,
           tick: float = 1.0, anticipate: bool = True) -> Result:
    """Serve ``trace`` (sorted Mooncake-shaped dicts with ``model``) for ``duration`` seconds.

    Exactly one of ``policies`` (autoscaled, each model starting with ``start`` ready
    replicas, default its ``min``) and ``fixed`` (that many ready replicas throughout) names
    the models. ``anticipate``: each scaler is told the start time, as the control plane tells
    it the start it measured (``autoscale_lead``; here every start takes ``lead``)."""
    if (policies is None) == (fixed is None):
        raise ValueError("give policies or fixed counts, not both")
    names = list(policies or fixed)
    if fixed is not None and sum(fixed.values()) > pool:
        raise ValueError(f"fixed counts {fixed} need more than the pool's {pool} GPUs")
    runs = {n: ModelRun(n) for n in names}
    queues: dict[str, deque] = {n: deque() for n in names}
    replicas: dict[str, list[Replica]] = {n: [] for n in names}
    scalers: dict[str, Scaler] = {}
    events: list[tuple[float, int, int, object]] = []  # (time, kind, seq, payload)
    seq = 0
    free = pool
    peak_placed = 0
    FINISH, READY, TICK = 0, 1, 2  # at one instant: free slots first, then new replicas, then the pass

    def push(t: float, kind: int, payload: object) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, kind, seq, payload))

    def place(name: str, now: float, ready_at: float) -> None:
        nonlocal free, peak_placed
        r = Replica(name, now, ready_at)
        replicas[name].append(r)
        free -= 1
        peak_placed = max(peak_placed, pool - free)
        runs[name].peak_replicas = max(runs[name].peak_replicas, len(replicas[name]))
        if ready_at > now:
            push(ready_at, READY, r)

    def stop(r: Replica, now: float) -> None:
        nonlocal free
        r.stopped_at = now
        runs[r.model].gpu_seconds += now - r.placed_at
        replicas[r.model].remove(r)
        free += 1

    def dispatch(name: str, now: float) -> None:
        q = queues[name]
        while q:
            best = None
            for r in replicas[name]:
                if not r.draining and r.ready_at <= now and r.running < engine.max_batch and (
                        best is None or r.running < best.running):
                    best = r
            if best is None:
                return
            arrival, inp, out, idx = q.popleft()
            best.running += 1
            itl = inter_token(engine.token, engine.slowdown, best.running)
            prefill = engine.prefill * inp
            runs[name].ttft[idx] = now - arrival + prefill + itl
            push(now + prefill + out * itl, FINISH, best)

    if fixed is not None:
        for n, count in fixed.items():
            for _ in range(count):
                place(n, 0.0, 0.0)
    else:
        for n, p in policies.items():
            scalers[n] = Scaler(p, (start or {}).get(n, p.min), 0.0)
            for _ in range(min(scalers[n].desired, free)):
                place(n, 0.0, 0.0)  # the opening count is up before the trace starts
        push(0.0, TICK, None)

    budget = Budget()

    def serving(name: str, now: float) -> int:
        """Replicas of ``name`` ready and not draining: the control plane's Ready count."""
        return sum(1 for r in replicas[name] if not r.draining and r.stopped_at is None and r.ready_at <= now)

    def reconcile(now: float) -> None:
        short: dict[str, int] = {}
        claims = [Claim(n, s.desired, s.policy.min, (priorities or {}).get(n, 0), 1, s.policy.scale_down_cooldown)
                  for n, s in scalers.items()]
        grants = budget.grant(claims, pool, now)
        for n in scalers:
            count = grants[n].granted
            runs[n].cut_seconds += (scalers[n].desired - count) * tick
            active = [r for r in replicas[n] if not r.draining]
            if count < len(active):
                # surplus: newest first; one still starting serves nothing and stops outright
                for r in sorted(active, key=lambda r: r.placed_at, reverse=True)[:len(active) - count]:
                    r.draining = True
                    if r.running == 0:
                        stop(r, now)
            elif count > len(active):
                short[n] = count - len(active)
        while free > 0 and short:
            n = max(short, key=lambda k: (short[k], -names.index(k)))
            place(n, now, now + lead)
            short[n] -= 1
            if not short[n]:
                del short[n]
        for n, missing in short.items():
            runs[n].unplaced_seconds += missing * tick

    i, total = 0, len(trace)
    while True:
        next_arrival = trace[i]["timestamp"] / 1000.0 if i < total else math.inf
        if events and events[0][0] <= next_arrival:
            now, kind, _, payload = heapq.heappop(events)
            if now > duration:
                break
            if kind == FINISH:
                r = payload
                r.running -= 1
                if r.draining:
                    if r.running == 0:
                        stop(r, now)
                else:
                    dispatch(r.model, now)
            elif kind == READY:
                if payload.stopped_at is None:
                    dispatch(payload.model, now)
            else:
                for n, s in scalers.items():
                    outstanding = len(queues[n]) + sum(r.running for r in replicas[n])
                    s.observe(now, outstanding)
                    if now < s.policy.stable_window:
                        continue  # the control plane's startup grace: a window measured first
                    before = s.desired
                    d = s.decide(now, lead if anticipate else None, serving(n, now))
                    if d.desired != before or not runs[n].decisions:
                        runs[n].decisions.append((now, d.desired, d.reason))
                reconcile(now)
                for n in names:
                    dispatch(n, now)
                push(now + tick, TICK, None)
        else:
            if next_arrival > duration:
                break
            line = trace[i]
            i += 1
            n = line["model"]
            run = runs[n]
            run.arrivals.append(next_arrival)
            run.ttft.append(math.inf)  # until admitted: a request never served counts as missed
            queues[n].append((next_arrival, line["input_length"], line["output_length"], len(run.ttft) - 1))
            if len(queues[n]) > run.max_queue:
                run.max_queue = len(queues[n])
            dispatch(n, next_arrival)
    for n in names:
        for r in replicas[n]:
            runs[n].gpu_seconds += duration - r.placed_at
    return Result(runs, duration, pool, peak_placed)


def window_p99(run: ModelRun, window: float, duration: float) -> list[tuple[float, int, float]]:
    """(window start, requests, TTFT p99) of each ``window`` of arrivals that had any."""
    buckets: dict[int, list[float]] = {}
    for a, t in zip(run.arrivals, run.ttft):
        buckets.setdefault(int(a // window), []).append(t)
    out = []
    for k in sorted(buckets):
        xs = sorted(buckets[k])
        out.append((k * window, len(xs), xs[min(len(xs) - 1, math.ceil(0.99 * len(xs)) - 1)]))
    return out


def reversals(decisions: list[tuple[float, int, str]]) -> list[float]:
    """Times at which the decided count changed direction."""
    out, last_dir, last = [], 0, None
    for t, desired, _ in decisions:
        if last is not None and desired != last:
            d = 1 if desired > last else -1
            if last_dir and d != last_dir:
                out.append(t)
            last_dir = d
        last = desired
    return out


def most_in_span(times: list[float], span: float) -> int:
    """The most of ``times`` inside any half-open interval ``span`` long."""
    best, j = 0, 0
    for k, t in enumerate(times):
        while times[j] <= t - span:
            j += 1
        best = max(best, k - j + 1)
    return best
