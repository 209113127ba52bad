"""The disaggregation benchmark's figures and report, from the runs' raw samples (pure: no I/O).

One run is one layout at one arrival rate, once: the client's TTFTs and inter-token gaps, the
output tokens, the wall time, the router's CPU seconds and what the engines and the router
counted. :func:`summarize` turns each run into percentiles, then each (layout, rate) into the
median of its repeats with their spread (min-max), so a difference between layouts is only
called one when the repeats do not overlap. :func:`markdown` writes it up with the targets.
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable

LAYOUTS = ("aggregated", "disaggregated")
FIGURES = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms",
           "itl_p50_ms", "itl_p90_ms", "itl_p99_ms", "itl_p999_ms", "output_tokens_per_s", "router_cpu_us_per_request")
HEADINGS = ("TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p90 ms", "TPOT p99 ms", "ITL p50 ms",
            "ITL p90 ms", "ITL p99 ms", "ITL p99.9 ms", "output tok/s", "router CPU us/request")


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile (0..1) of ``values``; None for none."""
    if not values:
        return None
    s = sorted(values)
    k = min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))
    return s[k]


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 1)


def run_figures(run: dict[str, Any]) -> dict[str, Any]:
    """One run's figures from its samples (seconds in, milliseconds out)."""
    ttft, itl, tpot = run["ttft_s"], run["itl_s"], run["tpot_s"]
    ok = run["ok"]
    out = {f"ttft_p{q}_ms": _ms(percentile(ttft, q / 100)) for q in (50, 90, 99)}
    out.update({f"tpot_p{q}_ms": _ms(percentile(tpot, q / 100)) for q in (50, 90, 99)})
    out.update({f"itl_p{q}_ms": _ms(percentile(itl, q / 100)) for q in (50, 90, 99)})
    out["itl_p999_ms"] = _ms(percentile(itl, 0.999))
    out["output_tokens_per_s"] = round(run["output_tokens"] / run["wall_s"], 1) if run["wall_s"] > 0 else None
    cpu = run.get("router_cpu_s")
    out["router_cpu_us_per_request"] = round(cpu / ok * 1e6) if cpu is not None and ok else None
    return out


def medians(figs: list[dict[str, Any]], names: Iterable[str], nd: int) -> dict[str, Any]:
    """Each named figure's median over the repeats' figures (rounded to ``nd`` places) and its
    ``_spread``, [min, max]; None for a figure no repeat had."""
    out: dict[str, Any] = {}
    for name in names:
        vals = [f[name] for f in figs if f[name] is not None]
        out[name] = round(statistics.median(vals), nd) if vals else None
        out[name + "_spread"] = [min(vals), max(vals)] if vals else None
    return out


def summarize(runs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (layout, rate), in rate then layout order: each figure's median over the repeats and
    its [min, max], the request counts summed, and the counters summed."""
    groups: dict[tuple[float, str], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["rate"], run["layout"]), []).append(run)
    out = []
    for (rate, layout), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], LAYOUTS.index(kv[0][1]))):
        figs = [run_figures(r) for r in rs]
        row: dict[str, Any] = {"layout": layout, "rate": rate, "repeats": len(rs),
                               "requests": sum(r["requests"] for r in rs), "ok": sum(r["ok"] for r in rs),
                               "errors": sum(r["requests"] - r["ok"] for r in rs)}
        row.update(medians(figs, FIGURES, 2))
        counters: dict[str, float] = {}
        for r in rs:
            for k, v in r.get("counters", {}).items():
                counters[k] = counters.get(k, 0) + v
        row["counters"] = counters
        out.append(row)
    return out


def _pair(rows: list[dict[str, Any]], rate: float) -> tuple[dict | None, dict | None]:
    by = {r["layout"]: r for r in rows if r["rate"] == rate}
    return by.get("aggregated"), by.get("disaggregated")


def compare(rows: list[dict[str, Any]], figure: str, lower_is_better: bool = True) -> list[dict[str, Any]]:
    """Per rate: ``figure`` for both layouts and whether disaggregated is better beyond the spread
    (its worst repeat better than aggregated's best); None where either was not measured."""
    out = []
    for rate in sorted({r["rate"] for r in rows}):
        agg, dis = _pair(rows, rate)
        if not agg or not dis or not agg.get(figure + "_spread") or not dis.get(figure + "_spread"):
            out.append({"rate": rate, "aggregated": None, "disaggregated": None, "better": None})
            continue
        (alo, ahi), (dlo, dhi) = agg[figure + "_spread"], dis[figure + "_spread"]
        better = dhi < alo if lower_is_better else dlo > ahi
        worse = dlo > ahi if lower_is_better else dhi < alo
        out.append({"rate": rate, "aggregated": agg[figure], "disaggregated": dis[figure],
                    "better": True if better else False if worse else None})
    return out


def added_cpu(rows: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """Per rate: the router's CPU per request disaggregated less aggregated (medians), where both exist."""
    out = []
    for rate in sorted({r["rate"] for r in rows}):
        agg, dis = _pair(rows, rate)
        if agg and dis and agg["router_cpu_us_per_request"] is not None \
                and dis["router_cpu_us_per_request"] is not None:
            out.append((rate, dis["router_cpu_us_per_request"] - agg["router_cpu_us_per_request"]))
    return out


def targets(rows: list[dict[str, Any]], transfer: dict[str, Any]) -> list[dict[str, str]]:
    """The issue's figures, each "met" only where this run measured it."""
    rates = sorted({r["rate"] for r in rows})
    both = all(all(_pair(rows, rate)) for rate in rates) and bool(rates)
    measured = both and all(r["ok"] > 0 and r["itl_p99_ms"] is not None for r in rows)
    cpu = both and all(r["router_cpu_us_per_request"] is not None for r in rows)
    errors = sum(r["errors"] for r in rows)

    def verdict(cmp: list[dict[str, Any]]) -> str:
        if not cmp or any(c["better"] is None and c["aggregated"] is None for c in cmp):
            return "not measured"
        marks = ["better" if c["better"] else "worse" if c["better"] is False else "within spread" for c in cmp]
        return "met" if all(c["better"] for c in cmp) else "not met (" + ", ".join(
            f"{c['rate']:g}/s: {m}" for c, m in zip(cmp, marks)) + ")"

    return [
        {"target": "TTFT and ITL p50/p90/p99 and output tokens/s, disaggregated vs aggregated at equal engine "
                   "count, long prompts, each rate", "result": "met" if measured else "not measured"},
        {"target": "transfer cost modelled and stated",
         "result": f"met: {transfer['per_token_us']:g} us per prompt token, {transfer['prompt_ms']:g} ms for one "
                   f"{transfer['prompt_tokens']}-token prompt"},
        {"target": "the router's CPU per request, both layouts, and what the two phases add",
         "result": ("met: two phases add " + ", ".join(
             f"{d:+g} us at {rate:g}/s" + ("" if c["better"] is not None else " (within the repeats' spread)")
             for (rate, d), c in zip(added_cpu(rows), compare(rows, "router_cpu_us_per_request")))
             + " per request") if cpu else "not measured"},
        {"target": "every request answered (disaggregation never fails a request)",
         "result": ("met" if errors == 0 else f"not met: {errors} failed") if measured else "not measured"},
        {"target": "TPOT p50 lower disaggregated than aggregated at every rate (prefills no longer stall decoding)",
         "result": verdict(compare(rows, "tpot_p50_ms"))},
        {"target": "ITL p99.9 lower disaggregated than aggregated at every rate (no stalled step on a decoder)",
         "result": verdict(compare(rows, "itl_p999_ms"))},
        {"target": "published: +30 % throughput per GPU (Dynamo, Llama-70B, one node)",
         "result": "not measured: a GPU figure; the simulator's throughput follows its timing knobs"},
    ]


def _cell(row: dict[str, Any], name: str) -> str:
    v, spread = row.get(name), row.get(name + "_spread")
    if v is None:
        return "n/a"
    if spread and row["repeats"] > 1:
        return f"{v:g} ({spread[0]:g}-{spread[1]:g})"
    return f"{v:g}"


def markdown(doc: dict[str, Any]) -> str:
    """The report: the model and workload stated, a table per rate, the comparison, the targets."""
    rows, s = doc["summary"], doc["settings"]
    t = s["transfer"]
    lines = [
        "# Prefill/decode disaggregation on the simulator",
        "",
        f"Command: `{doc['command']}` ({doc['when']}, {doc['machine']}).",
        "",
        f"Workload: {s['input_tokens']:,}-token prompts (each distinct: no prefix-cache hit), "
        f"{s['output_tokens']:,} output tokens, streamed `/v1/completions`, Poisson arrivals for "
        f"{s['duration_s']:g} s at each rate, then every answer drained; the same arrival schedule for both "
        f"layouts; {s['repeats']} repeat(s), layouts alternating.",
        "",
        f"Layouts at equal engine count ({s['engines']}), each behind one `llmgw router` (1 worker):",
        f"* **aggregated**: {s['engines']} engines, each prefilling and decoding;",
        f"* **disaggregated**: {s['prefill']} prefill (`kv_producer`) + {s['engines'] - s['prefill']} decode "
        "(`kv_consumer`, `kv_load_failure_policy: recompute`) engines, the router in two-phase mode.",
        "",
        "Engine model (`llmgw-engine-sim`, the same for every engine; figures chosen for a large model on a GPU "
        "group, not fitted to one):",
        "",
        "| setting | value |",
        "|---|---|",
    ]
    for k, v in s["knobs"].items():
        lines.append(f"| `{k}` | {v} |")
    lines += [
        f"| engine flags | `{' '.join(s['engine_args'])}` |",
        f"| KV transfer | {t['per_token_us']:g} us per prompt token: {t['prompt_ms']:g} ms for a "
        f"{t['prompt_tokens']:,}-token prompt ({t['why']}) |",
        f"| prefill of one prompt | {s['prefill_ms']:g} ms in {s['chunks_per_prompt']} chunk(s) of up to "
        f"{s['chunk_tokens']} tokens, each stalling every stream decoding on that engine |",
        "",
        "Figures: median of the repeats, (min-max) across them when more than one. TTFT, TPOT and ITL are the "
        "client's: TPOT is each request's mean time per output token after the first (its decode time over its "
        "tokens - 1, as vLLM's benchmark_serving reports it), ITL every gap between consecutive tokens of every "
        "stream (a stall is one long gap among a thousand, so it shows in p99.9 and in TPOT); output tokens/s is all tokens received over "
        "the run's wall time (first send to last token); router CPU is the router process tree's CPU time "
        "(/proc) over the run divided by the requests answered.",
        "",
    ]
    for rate in sorted({r["rate"] for r in rows}):
        lines += [f"## Arrival rate {rate:g}/s", "",
                  "| layout | requests (failed) | " + " | ".join(HEADINGS) + " |",
                  "|---|---|" + "---|" * len(HEADINGS)]
        for r in rows:
            if r["rate"] != rate:
                continue
            lines.append(f"| {r['layout']} | {r['ok']} ({r['errors']}) | " + " | ".join(
                _cell(r, n) for n in FIGURES) + " |")
        lines.append("")
        for r in rows:
            if r["rate"] == rate and r["counters"]:
                c = ", ".join(f"{k} {v:g}" for k, v in sorted(r["counters"].items()))
                lines.append(f"* {r['layout']}, all repeats: {c}")
        lines.append("")
    lines += ["## Targets", "", "| target | result |", "|---|---|"]
    lines += [f"| {t['target']} | {t['result']} |" for t in doc["targets"]]
    if doc.get("notes"):
        lines += ["", "## Reading it", ""] + [f"* {n}" for n in doc["notes"]]
    return "\n".join(lines) + "\n"
