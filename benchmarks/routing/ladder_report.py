"""The QPS ladder's figures, saturation, targets and report, from the runs' raw samples (pure: no I/O).

One run is one scorer at one arrival rate, once: the client's records (time sent, time to first
token, tokens, error), the wall time, and what the engines, the router and /proc counted over it.
:func:`run_figures` turns a run into its figures; :func:`summarize` takes each (scorer, rate) to
the median of its repeats with their spread (min-max).

Saturation is read from the queue, not from a latency threshold: offered more than it can serve,
a fleet's queue grows through the run, so the requests sent in the last quarter of the arrival
window wait longer than those of the first. A row is **saturated** where the median TTFT of its
last quarter is at least twice its first quarter's and at least one second more (below that,
the difference is a prefill or two, not a queue).
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable

from disagg_report import medians, percentile

SCORERS = ("least-outstanding", "prefix-affinity", "cache-aware")
FIGURES = ("ttft_p50_s", "ttft_p90_s", "output_tokens_per_s", "hit_rate", "router_cpu_us_per_request",
           "ttft_early_p50_s", "ttft_late_p50_s", "placed_by_index")
SATURATION_RATIO, SATURATION_MIN_S = 2.0, 1.0


def _r(v: float | None, nd: int = 3) -> float | None:
    return None if v is None else round(v, nd)


def quarters(run: dict[str, Any]) -> tuple[float | None, float | None]:
    """Median TTFT of the requests sent in the first and in the last quarter of the arrival window."""
    ok = [(r["sent"], r["ttft"]) for r in run["records"] if r["ok"]]
    if not ok:
        return None, None
    window = run["duration_s"]
    early = [t for s, t in ok if s < window / 4]
    late = [t for s, t in ok if s >= window * 3 / 4]
    return (statistics.median(early) if early else None), (statistics.median(late) if late else None)


def run_figures(run: dict[str, Any]) -> dict[str, Any]:
    """One run's figures from its records and counters."""
    ok = [r for r in run["records"] if r["ok"]]
    ttft = [r["ttft"] for r in ok]
    early, late = quarters(run)
    c = run["counters"]
    out = {"ttft_p50_s": _r(percentile(ttft, 0.5)), "ttft_p90_s": _r(percentile(ttft, 0.9)),
           "output_tokens_per_s": _r(sum(r["tokens"] for r in run["records"]) / run["wall_s"], 1)
           if run["wall_s"] > 0 else None,
           "hit_rate": _r(c["hits"] / c["queries"], 4) if c["queries"] else None,
           "router_cpu_us_per_request": round(run["cpu"]["router_s"] / len(ok) * 1e6) if ok else None,
           "ttft_early_p50_s": _r(early), "ttft_late_p50_s": _r(late),
           "placed_by_index": _r(c["placed_by_index"] / len(ok), 4) if ok and "placed_by_index" in c else None}
    return out


def saturated(row: dict[str, Any]) -> bool | None:
    early, late = row.get("ttft_early_p50_s"), row.get("ttft_late_p50_s")
    if early is None or late is None:
        return None
    return late >= SATURATION_RATIO * early and late - early >= SATURATION_MIN_S


def summarize(runs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (rate, scorer), in that order: each figure's median over the repeats and its [min, max],
    requests and errors summed, CPU shares (the largest over the repeats), and saturation."""
    groups: dict[tuple[float, str], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["rate"], run["scorer"]), []).append(run)
    out = []
    for (rate, scorer), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], SCORERS.index(kv[0][1]))):
        figs = [run_figures(r) for r in rs]
        row: dict[str, Any] = {"scorer": scorer, "rate": rate, "repeats": len(rs),
                               "requests": sum(len(r["records"]) for r in rs),
                               "errors": sum(sum(1 for x in r["records"] if not x["ok"]) for r in rs)}
        row.update(medians(figs, FIGURES, 4))
        row["cpu_share"] = {k: max(r["cpu_share"][k] for r in rs) for k in rs[0]["cpu_share"]}
        row["saturated"] = saturated(row)
        out.append(row)
    return out


def _rows(rows: list[dict[str, Any]], scorer: str) -> dict[float, dict[str, Any]]:
    return {r["rate"]: r for r in rows if r["scorer"] == scorer}


def saturation_rate(rows: list[dict[str, Any]], scorer: str) -> float | None:
    """The lowest rate at which ``scorer`` is saturated; None when it never is on the ladder."""
    sat = [rate for rate, r in sorted(_rows(rows, scorer).items()) if r["saturated"]]
    return sat[0] if sat else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's three figures, each with what was measured at every rate it covers and whether it was met."""
    lo, pa, ca = (_rows(rows, s) for s in SCORERS)
    sat = saturation_rate(rows, "prefix-affinity")
    rates = sorted(set(lo) & set(pa) & set(ca))
    past = [r for r in rates if sat is not None and r >= sat]
    below = [r for r in rates if sat is None or r < sat]
    where = (f"past prefix affinity's saturation (from {sat:g}/s)" if sat is not None
             else "past prefix affinity's saturation (it did not saturate on this ladder)")

    def verdict(values: list[tuple[float, float | None]], ok) -> dict[str, Any]:
        if not values or any(v is None for _, v in values):
            return {"measured": "not measured" if not values else
                    ", ".join(f"{r:g}/s: n/a" if v is None else f"{r:g}/s: {v:.2f}" for r, v in values),
                    "met": None}
        return {"measured": ", ".join(f"{r:g}/s: {v:.2f}" for r, v in values), "met": all(ok(v) for _, v in values)}

    ttft = verdict([(r, _ratio(lo[r]["ttft_p90_s"], ca[r]["ttft_p90_s"])) for r in past], lambda v: v >= 10)
    tput = verdict([(r, _ratio(ca[r]["output_tokens_per_s"], lo[r]["output_tokens_per_s"])) for r in past],
                   lambda v: v >= 1.3)
    below_ttft = [(r, _ratio(ca[r]["ttft_p90_s"], pa[r]["ttft_p90_s"])) for r in below]
    below_tput = [(r, _ratio(ca[r]["output_tokens_per_s"], pa[r]["output_tokens_per_s"])) for r in below]
    b1 = verdict(below_ttft, lambda v: v <= 1.05)
    b2 = verdict(below_tput, lambda v: v >= 0.95)
    below_met = None if b1["met"] is None or b2["met"] is None else b1["met"] and b2["met"]
    return [
        {"target": f"TTFT p90, {where}: least-outstanding / cache-aware >= 10", **ttft},
        {"target": f"output tokens/s, {where}: cache-aware / least-outstanding >= 1.3", **tput},
        {"target": "below prefix affinity's saturation, cache-aware no worse than prefix affinity by more than 5 %: "
                   "TTFT p90 cache-aware / prefix-affinity <= 1.05 and output tokens/s cache-aware / "
                   "prefix-affinity >= 0.95",
         "measured": f"TTFT p90 {b1['measured']}; tokens/s {b2['measured']}", "met": below_met},
    ]


def _cell(row: dict[str, Any], name: str, scale: float = 1.0, nd: int = 2) -> str:
    v, spread = row.get(name), row.get(name + "_spread")
    if v is None:
        return "n/a"
    text = f"{v * scale:.{nd}f}"
    if spread and row["repeats"] > 1:
        text += f" ({spread[0] * scale:.{nd}f}-{spread[1] * scale:.{nd}f})"
    return text


def _met(m: bool | None) -> str:
    return "n/a" if m is None else "met" if m else "not met"


def markdown(doc: dict[str, Any]) -> str:
    """The report: scale, model and workload stated, a table per rate, CPU shares, the targets."""
    rows, s = doc["summary"], doc["settings"]
    w = s["workload"]
    lines = [
        "# Cache-aware routing on a QPS ladder, through real processes",
        "",
        f"Command: `{doc['command']}` ({doc['when']}, {doc['machine']}; {doc['elapsed_s']:g} s).",
        "",
        f"Processes: a control plane, one agent, {s['replicas']} engine simulators launched by it (a profile with "
        "`kv_events`: each engine publishes its KV events, the agent relays them as route keys), and one "
        "standalone `llmgw router` per scorer on the control plane's watch (plain HTTP to the client, "
        "one worker): **least-outstanding** (the default), **prefix-affinity** (`balancing.scorer`, the "
        "approximate scorer) and **cache-aware** (`balancing.cache_aware`, fed by the route keys; prefix "
        "affinity where the index cannot speak). The load is the official `openai` client, streamed "
        "`/v1/completions`, open loop.",
        "",
        f"Workload (seeded; the same requests at the same times for every scorer): {w['groups']} groups, each "
        f"sharing a {w['system']:,}-token system prompt, {w['users']} users in conversation per group, "
        f"{w['turns']} turns a user ({w['question']}-token questions, {w['answer']}-token answers joining the "
        f"history; prompts of {w['prompt_tokens'][0]:,} to {w['prompt_tokens'][-1]:,} tokens), then a new user. "
        f"Poisson arrivals for {s['duration_s']:g} s at each rate of the ladder "
        f"({', '.join(f'{r:g}' for r in s['rates'])}/s), "
        f"ascending, every answer drained before the next rate; {s['repeats']} repeat(s), scorers in alternating "
        "order; each scorer's ladder on a fleet of its own, started for it, so every engine's prefix cache "
        "starts empty" + (f", then warmed by {s['warmup']['seconds']:g} s of the same workload at "
                          f"{s['warmup']['rate']:g}/s, not measured." if s["warmup"]["seconds"] else "."),
        "",
        "Engine model (`llmgw-engine-sim`, every engine alike):",
        "",
        "| setting | value |",
        "|---|---|",
    ]
    for k, v in s["knobs"].items():
        lines.append(f"| `{k}` | {v} |")
    lines += [
        f"| KV cache | {s['kv_blocks']:,} blocks of 16 tokens ({s['kv_tokens']:,} tokens) per engine |",
        "",
        f"What the engines' prefill lanes can take, from the model alone: {s['modelled_capacity_rps']['no_hits']:g} "
        f"requests/s when no prompt token is cached, {s['modelled_capacity_rps']['system_prompts_hit']:g}/s when "
        f"every system prompt is (mean prompt {w['mean_prompt_tokens']:,} tokens).",
        "",
        f"Scale and why: {s['scale']}",
        "",
        "Figures: median of the repeats, (min-max) across them when more than one. TTFT is the client's, to "
        "the first token; output tokens/s is every token received over the run's wall time (first send to last "
        "token, the drain included); hit rate is the engines' own `vllm:prefix_cache_hits_total` over "
        "`vllm:prefix_cache_queries_total`, summed over the engines, as deltas over the run; router CPU is the "
        "router process's CPU time (/proc) over the run divided by the requests answered; early/late TTFT "
        "p50 are the medians of the requests sent in the first and last quarter of the arrival window, "
        "from which saturation is read (late >= "
        f"{SATURATION_RATIO:g} x early and >= {SATURATION_MIN_S:g} s more: the queue grew through the run).",
        "",
    ]
    heads = ("requests (failed)", "TTFT p50 s", "TTFT p90 s", "output tok/s", "engines' hit rate %",
             "router CPU us/request", "early / late TTFT p50 s", "saturated")
    for rate in sorted({r["rate"] for r in rows}):
        lines += [f"## {rate:g} requests/s", "", "| scorer | " + " | ".join(heads) + " |",
                  "|---|" + "---|" * len(heads)]
        for r in rows:
            if r["rate"] != rate:
                continue
            lines.append(
                f"| {r['scorer']} | {r['requests']} ({r['errors']}) | {_cell(r, 'ttft_p50_s')} | "
                f"{_cell(r, 'ttft_p90_s')} | {_cell(r, 'output_tokens_per_s', nd=0)} | "
                f"{_cell(r, 'hit_rate', 100, 1)} | {_cell(r, 'router_cpu_us_per_request', nd=0)} | "
                f"{_cell(r, 'ttft_early_p50_s')} / {_cell(r, 'ttft_late_p50_s')} | "
                f"{'yes' if r['saturated'] else 'no' if r['saturated'] is False else 'n/a'} |")
        ca = [r for r in rows if r["rate"] == rate and r["scorer"] == "cache-aware" and r.get("placed_by_index")]
        if ca:
            lines += ["", f"Cache-aware requests placed by the index: {_cell(ca[0], 'placed_by_index', 100, 1)} %."]
        lines.append("")
    top = max(r["rate"] for r in rows)
    lines += [f"## CPU at the top rate ({top:g}/s)", "",
              "Each process's CPU time over the run's wall time (1.0 = one core busy), the largest over the "
              f"repeats; the machine has {doc['cores']} cores.", "",
              "| scorer | router | busiest engine | all engines | control plane + agent | client (this process) | "
              "whole machine (other work on it included) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["rate"] == top:
            c = r["cpu_share"]
            lines.append(f"| {r['scorer']} | {c['router']:.2f} | {c['engine_max']:.2f} | {c['engines']:.2f} | "
                         f"{c['control']:.2f} | {c['client']:.2f} | {c['machine']:.2f} |")
    lines += ["", "## Saturation", ""]
    for sc in SCORERS:
        sat = saturation_rate(rows, sc)
        lines.append(f"* {sc}: " + (f"saturated from {sat:g}/s" if sat is not None else "not saturated on this ladder"))
    lines += ["", "## Targets", "", "| target | measured | met |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['measured']} | {_met(t['met'])} |" for t in doc["targets"]]
    if doc.get("notes"):
        lines += ["", "## Reading it", ""] + [f"* {n}" for n in doc["notes"]]
    return "\n".join(lines) + "\n"
