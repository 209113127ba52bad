"""Autoscaling on a diurnal two-model trace against static peak provisioning, and the rule's cost.

    PYTHONPATH=agent .venv/bin/python benchmarks/autoscale/run.py [--quick] [--seeds 1 2 3]
        [--trace FILE.jsonl] [--no-write]

For each seed: a trace from ``trace.py`` (or ``--trace``, a Mooncake-shaped JSONL with a
``model`` key), replayed by ``replay.py`` in simulated time, three ways on one engine model:

1. **autoscaled**: each model under ``llmgw.controlplane.autoscale.Scaler`` with ``target``
   16 (the engine's batch), ``headroom`` 2.5 (square-root staffing), ``max_scale_up_rate``
   2, ``scale_down_stabilization`` 120 s and ``panic_threshold`` 3, the catalog's defaults otherwise (stable 60 s, panic 6 s, tolerance 0.1, cooldown
   300 s, step 4), ``min`` 1, ``max`` 32, in a pool as large as static provisioning's (so
   the pool never binds: the rule alone sets the counts); and again with the catalog's
   defaults alone (target 8, none of those three), for the side-by-side ratio;
2. **static peak**: each model at a fixed count, its *own* peak need: the fewest replicas
   that meet the TTFT objective over the whole day with the count never moving (searched
   down from the autoscaled run's peak).  This is the strict baseline: a static replica
   may fill its whole batch, tuned with hindsight of the whole day.  For scale, the saving
   is also given against static counts at the autoscaled run's peak count of each model;
3. **tight pool**: autoscaled again in a pool of 75 % of static provisioning's GPUs (the
   two models' peak needs together), arbitrated by the real fleet GPU budget (``autoscale_budget.Budget``,
   equal priorities), to show what happens when the models' needs together exceed it;
4. **blind**: autoscaled as in 1, the scalers told no start time (the rule before it
   followed a rising signal ahead by the lead time the control plane measures), for the
   side-by-side ratio of what anticipation saves.

The TTFT objective: a 60 s window of a model's arrivals meets it when their TTFT p99 is
at most 2 s; the target is 99 % of windows.  A reversal is a change of the decided count's
direction; the target is at most one in any cooldown (300 s).

Then the rule's own cost: 10,000 scalers (one per deployment: the 10,000-node figure's
worst case of one deployment a node) each observe and decide once per pass, in a tight
loop over the real ``Scaler``; decisions per second and the CPU read from
``/proc/self/stat`` around it.

``--quick``: a one-hour day at a quarter of the load, one seed, 1,000 scalers: a few
seconds, for CI.  Writes benchmarks/results/autoscale.json and autoscale.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import importlib.util

HERE = Path(__file__).resolve().parent


def _sibling(name: str):
    """Load ``name``.py beside this file under a name of its own (``trace`` is also a stdlib module)."""
    key = f"autoscale_bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, HERE / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod  # dataclasses look their module up by name
        spec.loader.exec_module(mod)
    return sys.modules[key]


rp = _sibling("replay")
tr = _sibling("trace")
machine = _sibling("machine")

from llmgw.agent.procident import read_stat  # noqa: E402
from llmgw.catalog import Autoscale  # noqa: E402
from llmgw.controlplane.autoscale import Scaler, wanted  # noqa: E402
from llmgw.sim.sim_timing import inter_token  # noqa: E402

RESULTS = HERE.parent / "results"
OBJECTIVE_S = 2.0  # TTFT p99 per window
WINDOW_S = 60.0
SHARE_TARGET = 0.99
SAVING_TARGET = 0.30
LEAD_S = 90.0  # a new replica's time to ready: fetch from local cache and load
# the batch as the target, square-root headroom, scale-ups held to twice the serving replicas,
# scale-downs to the most wanted over 2 minutes (longer than a replica's start), panic at 3 times
# the count (at 2, one replica panicked at every burst its own batch absorbed)
POLICY = Autoscale(max=32, target=16.0, headroom=2.5, max_scale_up_rate=2.0, scale_down_stabilization=120.0,
                   panic_threshold=3.0)
DEFAULTS = Autoscale(max=32)  # the catalog's defaults alone: target 8 a replica, none of the three above
TIGHT = 0.75  # of static provisioning's GPUs: the pool the tight run arbitrates


def window_share(run: rp.ModelRun, duration: float) -> tuple[float, int, float]:
    """(share of windows meeting the objective, windows, worst window p99)."""
    w = rp.window_p99(run, WINDOW_S, duration)
    ok = sum(1 for _, _, p in w if p <= OBJECTIVE_S)
    return (ok / len(w) if w else 1.0), len(w), max((p for _, _, p in w), default=0.0)


def static_need(lines: list[dict], name: str, start: int, duration: float, engine: rp.Engine) -> int:
    """The fewest fixed replicas of ``name`` meeting the objective all day (from ``start`` down;
    up if ``start`` itself does not)."""
    mine = [d for d in lines if d["model"] == name]

    def meets(c: int) -> bool:
        res = rp.replay(mine, duration, c, engine, LEAD_S, fixed={name: c})
        return window_share(res.models[name], duration)[0] >= SHARE_TARGET

    c = max(1, start)
    if not meets(c):
        while not meets(c) and c < 4 * start + 4:
            c += 1
        return c
    while c > 1 and meets(c - 1):
        c -= 1
    return c


def opening_count(lines: list[dict], name: str, engine: rp.Engine, policy: Autoscale) -> int:
    """The count a model starts the replay with: what its first minute asks of the rule, by
    Little's law (arrivals x service time at the target batch: the requests in flight), as if
    the day before had run; starting at ``min`` instead would replay a cold start into the load."""
    itl = inter_token(engine.token, engine.slowdown, max(1, round(policy.target)))
    busy = sum(engine.prefill * d["input_length"] + d["output_length"] * itl
               for d in lines if d["model"] == name and d["timestamp"] < 60_000)
    return policy.clamp(wanted(policy, busy / 60.0))


def summarize(res: rp.Result, cooldown: float) -> dict:
    out = {"gpu_hours": round(res.gpu_hours, 3), "pool": res.pool, "peak_gpus_held": res.peak_placed, "models": {}}
    for n, m in res.models.items():
        share, windows, worst = window_share(m, res.duration)
        revs = rp.reversals(m.decisions)
        served = [t for t in m.ttft if t != math.inf]
        out["models"][n] = {
            "requests": len(m.ttft), "never_served": len(m.ttft) - len(served),
            "gpu_hours": round(m.gpu_seconds / 3600.0, 3), "peak_replicas": m.peak_replicas,
            "windows": windows, "windows_meeting": round(share, 4), "worst_window_p99_s": round(worst, 3),
            "ttft_p99_s": round(sorted(m.ttft)[min(len(m.ttft) - 1, math.ceil(0.99 * len(m.ttft)) - 1)], 3)
            if m.ttft else None,
            "count_changes": max(0, len(m.decisions) - 1), "reversals": len(revs),
            "most_reversals_per_cooldown": rp.most_in_span(revs, cooldown),
            "cut_replica_hours": round(m.cut_seconds / 3600.0, 3),
            "unplaced_replica_hours": round(m.unplaced_seconds / 3600.0, 3), "max_queue": m.max_queue,
        }
    return out


def one_seed(seed: int, day: float, peak_rps: float, engine: rp.Engine, trace_file: str | None,
             policy: Autoscale, defaults: Autoscale = DEFAULTS) -> dict:
    lines = tr.read_jsonl(trace_file) if trace_file else tr.generate(tr.default_models(peak_rps), day, seed)
    duration = max(day, lines[-1]["timestamp"] / 1000.0) if trace_file else day
    names = sorted({d["model"] for d in lines}, key=lambda n: [d["model"] for d in lines].index(n)) \
        if trace_file else [m.name for m in tr.default_models()]
    policies = {n: policy for n in names}
    start = {n: opening_count(lines, n, engine, policy) for n in names}
    auto = rp.replay(lines, duration, policy.max * len(names), engine, LEAD_S, policies=policies, start=start)
    fixed = {n: static_need(lines, n, auto.models[n].peak_replicas, duration, engine) for n in names}
    static = rp.replay(lines, duration, sum(fixed.values()), engine, LEAD_S, fixed=fixed)
    auto.pool = sum(fixed.values())  # the same pool: the autoscaled run never held more than this at once
    if auto.peak_placed > auto.pool:
        auto.pool = auto.peak_placed
    tight_pool = max(len(names), int(TIGHT * sum(fixed.values())))
    tight = rp.replay(lines, duration, tight_pool, engine, LEAD_S, policies=policies, start=start)
    blind = rp.replay(lines, duration, policy.max * len(names), engine, LEAD_S, policies=policies, start=start,
                      anticipate=False)
    plain = rp.replay(lines, duration, defaults.max * len(names), engine, LEAD_S,
                      policies={n: defaults for n in names},
                      start={n: opening_count(lines, n, engine, defaults) for n in names})
    c = policy.scale_down_cooldown
    a, s, t, b = summarize(auto, c), summarize(static, c), summarize(tight, c), summarize(blind, c)
    d = summarize(plain, defaults.scale_down_cooldown)
    same = {n: auto.models[n].peak_replicas for n in names}  # sized by the rule's own target at the peak
    same_hours = sum(same.values()) * duration / 3600.0
    return {"seed": seed, "requests": len(lines), "duration_s": duration, "static_counts": fixed, "opening_counts": start,
            "saving": round(1.0 - a["gpu_hours"] / s["gpu_hours"], 4),
            "static_same_target_counts": same, "static_same_target_gpu_hours": round(same_hours, 3),
            "saving_vs_same_target": round(1.0 - a["gpu_hours"] / same_hours, 4),
            "saving_blind": round(1.0 - b["gpu_hours"] / s["gpu_hours"], 4),
            "saving_defaults": round(1.0 - d["gpu_hours"] / s["gpu_hours"], 4),
            "autoscaled": a, "static": s, "tight": t, "blind": b, "defaults": d}


def cpu_seconds() -> float:
    st = read_stat(os.getpid())
    return st.cpu_ticks / os.sysconf("SC_CLK_TCK")


def decision_rate(scalers: int, passes: int, policy: Autoscale) -> dict:
    """``scalers`` deployments, each observed and decided once a pass for ``passes`` passes
    after a stable window of samples (untimed, as a running control plane would have), each
    told a measured start time, as the control plane tells it (the trend is then worked out)."""
    import random
    rng = random.Random(0)
    now = 0.0
    fleet = [Scaler(policy, 4, now) for _ in range(scalers)]
    signal = [rng.uniform(0.0, 60.0) for _ in range(1024)]
    for k in range(int(policy.stable_window) + 1):
        now += 1.0
        for i, s in enumerate(fleet):
            s.observe(now, signal[(i + k) & 1023])
    wall0, cpu0 = time.perf_counter(), cpu_seconds()
    for k in range(passes):
        now += 1.0
        for i, s in enumerate(fleet):
            s.observe(now, signal[(i * 7 + k) & 1023])
            s.decide(now, LEAD_S)
    wall, cpu = time.perf_counter() - wall0, cpu_seconds() - cpu0
    n = scalers * passes
    return {"scalers": scalers, "passes": passes, "decisions": n, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
            "decisions_per_s": round(n / wall), "cpu_per_pass_s": round(cpu / passes, 4),
            "core_share_at_one_pass_per_s": round(cpu / passes, 4)}


def spread(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4)}


def report(r: dict) -> str:
    m = r["meta"]
    p = m["policy"]
    seeds = r["seeds"]
    sav = r["spread"]["saving"]
    share = r["spread"]["windows_meeting"]
    rev = max(x["autoscaled"]["models"][n]["most_reversals_per_cooldown"] for x in seeds for n in x["autoscaled"]["models"])
    d = r["decisions"]
    lines = [
        "# Autoscaling: a diurnal two-model trace on a fixed pool",
        "",
        f"`{m['command']}`",
        "",
        f"Run {m['date']} on {m['cpu_model']} ({m['cpus']} cores, shared), Python {m['python']}. "
        f"Simulated time: no processes, no sleeps; the decisions are the real "
        f"`llmgw.controlplane.autoscale.Scaler`.",
        "",
        f"Trace: `benchmarks/autoscale/trace.py`, generated, seeds {m['seeds']}: two models in Mooncake's JSONL "
        f"shape (`timestamp` ms, `input_length`, `output_length`, plus `model`), lengths imitating Mooncake's "
        f"conversation (`chat`) and tool-agent (`agent`) traces, a daily curve imposed on each (trough 15 % of "
        f"the peak, `chat` busiest at 14:00, `agent` at 00:00), a day compressed into {m['day_s']:g} s "
        f"starting at 07:00, {m['peak_rps']:g} requests/s per model at its peak.",
        "",
        f"Engine model (the simulator's `vllm-cpu-tiny` timing preset, benchmarks/results/simfit.md): prefill "
        f"{m['engine']['prefill']:g} s/token, decode {m['engine']['token']:g} s/token alone x (1 + "
        f"{m['engine']['slowdown']:g} x (batch - 1)), at most {m['engine']['max_batch']} requests a replica, "
        f"one GPU a replica; a new replica serves {m['lead_s']:g} s after it is placed. Policy: target "
        f"{p['target']:g} outstanding per replica (the engine's batch), headroom {p['headroom']:g} "
        f"(`headroom` x sqrt(in flight) spare slots), max_scale_up_rate {p['max_scale_up_rate']:g}, "
        f"scale_down_stabilization {p['scale_down_stabilization']:g} s, panic_threshold {p['panic_threshold']:g}, "
        f"the catalog's defaults otherwise (stable {p['stable_window']:g} s, "
        f"panic {p['panic_window']:g} s, tolerance {p['tolerance']:g}, cooldown {p['scale_down_cooldown']:g} s, "
        f"step {p['max_step']}), min {p['min']}, max {p['max']}.",
        "",
        "## Targets",
        "",
        "| target | goal | measured (median, min-max over seeds) | met |",
        "|---|---|---|---|",
        f"| GPU-hours saved against static peak provisioning | >= 30 % | {100 * sav['median']:.1f} % "
        f"({100 * sav['min']:.1f}-{100 * sav['max']:.1f}) | {'yes' if sav['min'] >= SAVING_TARGET else 'no'} |",
        f"| the same, static at the count the rule reached at each model's peak | (for scale) | "
        f"{100 * r['spread']['saving_vs_same_target']['median']:.1f} % ({100 * r['spread']['saving_vs_same_target']['min']:.1f}"
        f"-{100 * r['spread']['saving_vs_same_target']['max']:.1f}) | - |",
        f"| the same, the catalog's defaults alone (target 8 a replica, no headroom, rate cap or stabilization) | (for comparison) | "
        f"{100 * r['spread']['saving_defaults']['median']:.1f} % ({100 * r['spread']['saving_defaults']['min']:.1f}"
        f"-{100 * r['spread']['saving_defaults']['max']:.1f}); windows met {100 * r['spread']['windows_meeting_defaults']['median']:.2f} % "
        f"({100 * r['spread']['windows_meeting_defaults']['min']:.2f}-{100 * r['spread']['windows_meeting_defaults']['max']:.2f}) | - |",
        f"| the same, the rule told no start time (blind) | (for comparison) | "
        f"{100 * r['spread']['saving_blind']['median']:.1f} % ({100 * r['spread']['saving_blind']['min']:.1f}"
        f"-{100 * r['spread']['saving_blind']['max']:.1f}); windows met {100 * r['spread']['windows_meeting_blind']['median']:.2f} % "
        f"({100 * r['spread']['windows_meeting_blind']['min']:.2f}-{100 * r['spread']['windows_meeting_blind']['max']:.2f}) | - |",
        f"| 60 s windows whose TTFT p99 <= {OBJECTIVE_S:g} s (both models) | >= 99 % | {100 * share['median']:.2f} % "
        f"({100 * share['min']:.2f}-{100 * share['max']:.2f}) | {'yes' if share['min'] >= SHARE_TARGET else 'no'} |",
        f"| reversals of the count in any cooldown ({p['scale_down_cooldown']:g} s) | <= 1 | {rev} | {'yes' if rev <= 1 else 'no'} |",
        f"| {d['scalers']:,} deployments decided within one 1 s pass | CPU per pass < 1 s | "
        f"{d['cpu_per_pass_s']:.3f} s CPU a pass, {d['decisions_per_s']:,} decisions/s | "
        f"{'yes' if d['cpu_per_pass_s'] < 1.0 else 'no'} |",
        "",
        "## Per seed",
        "",
        "| seed | requests | static counts | GPU-h static | GPU-h autoscaled | saving | windows met (chat / agent) "
        "| worst window p99 s (chat / agent) | count changes | reversals (most per cooldown) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in seeds:
        a, s = x["autoscaled"], x["static"]
        am = a["models"]
        names = list(am)
        lines.append(
            f"| {x['seed']} | {x['requests']:,} | " + " / ".join(f"{n} {x['static_counts'][n]}" for n in names)
            + f" | {s['gpu_hours']:.1f} | {a['gpu_hours']:.1f} | {100 * x['saving']:.1f} % | "
            + " / ".join(f"{100 * am[n]['windows_meeting']:.1f} %" for n in names) + " | "
            + " / ".join(f"{am[n]['worst_window_p99_s']:.2f}" for n in names) + " | "
            + " / ".join(str(am[n]['count_changes']) for n in names) + " | "
            + " / ".join(f"{am[n]['reversals']} ({am[n]['most_reversals_per_cooldown']})" for n in names) + " |")
    lines += [
        "",
        "Static peak provisioning, checked the same way (its windows met, chat / agent): "
        + "; ".join(f"seed {x['seed']}: " + " / ".join(f"{100 * v['windows_meeting']:.1f} %"
                                                      for v in x["static"]["models"].values()) for x in seeds) + ".",
        "",
        "## When the pool is too small for both",
        "",
        f"The same trace, autoscaled, in a pool of {int(TIGHT * 100)} % of static provisioning's GPUs (both "
        "models' peak needs together), arbitrated by the fleet GPU budget (`controlplane/autoscale_budget.py`, both models at "
        "priority 0: they share what is above their mins in proportion to demand). Cut: replica-hours a "
        "scaler asked for beyond its grant; waiting: granted replica-hours not yet placed because the GPUs "
        "were still draining from the other model.",
        "",
        "| seed | pool | cut replica-h (chat / agent) | waiting replica-h (chat / agent) | windows met (chat / agent) "
        "| worst window p99 s | longest queue |",
        "|---|---|---|---|---|---|---|",
    ]
    for x in seeds:
        t = x["tight"]
        tm = t["models"]
        names = list(tm)
        lines.append(
            f"| {x['seed']} | {t['pool']} | " + " / ".join(f"{tm[n]['cut_replica_hours']:.2f}" for n in names)
            + " | " + " / ".join(f"{tm[n]['unplaced_replica_hours']:.2f}" for n in names)
            + " | " + " / ".join(f"{100 * tm[n]['windows_meeting']:.1f} %" for n in names) + " | "
            + " / ".join(f"{tm[n]['worst_window_p99_s']:.1f}" for n in names) + " | "
            + " / ".join(str(tm[n]['max_queue']) for n in names) + " |")
    lines += [
        "",
        "## The rule's cost",
        "",
        f"{d['scalers']:,} scalers, each with a stable window of samples, observed and decided {d['passes']} "
        f"times in a tight loop: {d['decisions']:,} decisions in {d['wall_s']:.2f} s "
        f"({d['decisions_per_s']:,}/s), {d['cpu_s']:.2f} s of CPU (user + system, /proc/self/stat): "
        f"{d['cpu_per_pass_s']:.3f} s of one core for each pass over all of them, that share of a core at "
        f"the control plane's one pass a second. One deployment a node is the worst case at 10,000 nodes; "
        f"a fleet's deployments are usually far fewer than its nodes.",
        "",
        "## What this does not show",
        "",
        "- The timing constants are the simulator's fit to vLLM's CPU build on a tiny model, not a GPU; GPU-hours "
        "here are replica-hours of that engine model. The shape (saving, windows met, reversals) is what carries over.",
        "- Decode time is fixed at admission from the batch then; a replica's batch is capped, KV memory is not "
        "modelled beyond that cap, nor the prefix cache.",
        f"- Anticipation is told the true start time ({m['lead_s']:g} s, every start alike); the control plane "
        "tells it the median of the last starts it saw, which a fleet with uneven nodes or caches spreads.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a one-hour day, a quarter of the load, one seed")
    ap.add_argument("--seeds", type=int, nargs="+")
    ap.add_argument("--day", type=float, help="simulated seconds a day is compressed to (default 14400)")
    ap.add_argument("--peak-rps", type=float, help="each model's requests per second at its peak (default 60)")
    ap.add_argument("--scalers", type=int, help="deployments for the decision rate (default 10000)")
    ap.add_argument("--passes", type=int, default=None, help="timed passes over them (default 10)")
    ap.add_argument("--target", type=float, default=POLICY.target,
                    help=f"outstanding requests per replica the rule aims for (default {POLICY.target:g})")
    ap.add_argument("--headroom", type=float, default=POLICY.headroom,
                    help=f"spare slots in standard deviations of the demand (default {POLICY.headroom:g})")
    ap.add_argument("--rate", type=float, default=POLICY.max_scale_up_rate,
                    help=f"max_scale_up_rate: a scale-up to at most this many times the serving replicas "
                         f"(default {POLICY.max_scale_up_rate:g}; 0: no cap)")
    ap.add_argument("--trace", help="replay this Mooncake-shaped JSONL instead of generating")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--out-dir", default=str(RESULTS))
    args = ap.parse_args(argv)
    q = args.quick
    policy = dataclasses.replace(POLICY, target=args.target, headroom=args.headroom, max_scale_up_rate=args.rate)
    seeds = args.seeds or ([1] if q else [1, 2, 3])
    day = args.day or (3600.0 if q else 14_400.0)
    peak = args.peak_rps or (30.0 if q else 60.0)
    engine = rp.Engine()
    per_seed = []
    for seed in seeds:
        t0 = time.perf_counter()
        x = one_seed(seed, day, peak, engine, args.trace, policy)
        per_seed.append(x)
        print(f"seed {seed}: {x['requests']} requests, saving {100 * x['saving']:.1f} % "
              f"(blind {100 * x['saving_blind']:.1f} %, catalog defaults {100 * x['saving_defaults']:.1f} %), "
              f"static {x['static_counts']}, {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    decisions = decision_rate(args.scalers or (1000 if q else 10_000), args.passes or (2 if q else 10), policy)
    shares = [m["windows_meeting"] for x in per_seed for m in x["autoscaled"]["models"].values()]
    blind_shares = [m["windows_meeting"] for x in per_seed for m in x["blind"]["models"].values()]
    default_shares = [m["windows_meeting"] for x in per_seed for m in x["defaults"]["models"].values()]
    flags = " ".join(a for a in (argv if argv is not None else sys.argv[1:]))
    r = {
        "meta": {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
                 "cpu_model": machine.cpu_model(), "python": platform.python_version(), "quick": q, "seeds": seeds,
                 "day_s": day, "peak_rps": peak, "lead_s": LEAD_S, "objective_ttft_p99_s": OBJECTIVE_S,
                 "window_s": WINDOW_S, "engine": dataclasses.asdict(engine),
                 "policy": dataclasses.asdict(policy),
                 "command": f"PYTHONPATH=agent .venv/bin/python benchmarks/autoscale/run.py {flags}".rstrip(),
                 "trace": args.trace or "generated (benchmarks/autoscale/trace.py)"},
        "seeds": per_seed,
        "spread": {"saving": spread([x["saving"] for x in per_seed]),
                   "saving_vs_same_target": spread([x["saving_vs_same_target"] for x in per_seed]),
                   "saving_blind": spread([x["saving_blind"] for x in per_seed]),
                   "saving_defaults": spread([x["saving_defaults"] for x in per_seed]),
                   "windows_meeting": spread(shares), "windows_meeting_blind": spread(blind_shares),
                   "windows_meeting_defaults": spread(default_shares)},
        "decisions": decisions,
    }
    md = report(r)
    print(md)
    if not args.no_write:
        machine.write_results(args.out_dir, "autoscale", r, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
