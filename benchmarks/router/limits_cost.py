#!/usr/bin/env python3
"""What per-key limits cost the router: CPU per request and per chunk, limited key against the same key unlimited.

Both routers are this tree's, each with one worker on the CPU kept for the proxy (``run.py``'s
isolated layout): ``llmgw-1w-key`` (the load generator's key configured, no ``limits``) and
``llmgw-1w-limits`` (the same key limited on all six dimensions, none reached, so every request
is reserved, settled from the engine's usage and answered with the rate-limit headers; streams
ask for and strip the usage event). Each router's CPU is read from ``/proc`` over its load
generator's measured window (``run.measure``).

Why the two are measured at once, at a set rate. A router's CPU per request depends on how
many requests each wake of its event loop finds. In ``run.py``'s closed loop that follows the
speed of the load generator and the engine simulator on the other CPU, and on a shared host
that speed drifts by more than the cost judged within seconds: one target measured after the
other, rounds of the same tree gave ratios from 1.08 to 1.28. Here each sample runs both
targets side by side, each from a load generator of its own sending the same fixed schedule
(``loadgen --rate``), so both routers meet the same arrivals on the same CPU at the same
moments and whatever slows that CPU slows both; a sample's ratio is the limited router's CPU
per request over the key-only router's in that sample. Rounds start both routers afresh
(which one starts first alternating) so that what differs between two processes of the same
code shows in the spread; a round's ratio is the median of its samples', the judged figure
the median of the rounds' with their range. The in-process table (``limits_path.py``) splits
the limited path's added work into its steps.

    python benchmarks/router/limits_cost.py [--rounds 5] [--repeat 3] [--duration 6]
    python benchmarks/router/limits_cost.py --quick --out /tmp/limits   # seconds, not minutes
    python benchmarks/router/limits_cost.py --base main --rate-scale 0.7 --out /tmp/limits-ab

``--base REV`` adds a third router beside the two, ``llmgw-1w-limits-base``: REV's router (its
``agent/`` exported from git) with the same limited key, so what a change to the limited path
saved is measured at the same moments as the cost itself. Three load generators share the other
CPU with the simulator, so such a run wants lower rates (``--rate-scale``): the served column
says whether every schedule was kept.

Writes ``<out>.json`` (every sample) and ``<out>.md`` (per-round figures, the ratios with
their spread, whether the 10 % target is met, and the in-process steps).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics as st
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import limits_path  # noqa: E402
import run  # noqa: E402
from ab import export, spread, write  # noqa: E402

KEY, LIMITED = TARGETS = ("llmgw-1w-key", "llmgw-1w-limits")
BASE = "llmgw-1w-limits-base"
TARGET = 1.10


@dataclass(frozen=True)
class Figure:
    workload: str
    stream: bool
    max_tokens: int
    rate: float  # requests a second each target is sent
    key: str  # the figure in run.measure's result
    what: str
    unit: str  # what the rate counts

    def load(self, duration: float, warmup: float, scale: float) -> run.Workload:
        return run.Workload(self.workload, "fast", self.stream, self.max_tokens, 16, duration, self.what,
                            ["--rate", f"{self.rate * scale:g}"], warmup=warmup)

    def label(self, scale: float) -> str:
        return f"{self.what}, {self.rate * scale:,g} {self.unit}/s)"


# Rates both routers take at once with the two load generators and the simulator sharing the other
# CPU of a 2-CPU host (below them, every sample's arrivals keep to the schedule).
FIGURES = (Figure("small-c16", False, 1, 1000, "proxy_cpu_per_request_us", "CPU per request (1 token, not streamed",
                  "requests"),
           Figure("stream-64", True, 64, 200, "proxy_cpu_per_chunk_us", "CPU per chunk (64-token streams", "streams"))


def side_by_side(targets: list[run.Target], w: run.Workload, cpus: str | None) -> dict[str, dict]:
    """``w`` on every target at once, each from its own load generator: their ``run.measure`` results."""
    out: dict[str, dict] = {}

    def one(t: run.Target) -> None:
        try:
            out[t.name] = run.measure(t, w, cpus)
        except Exception as e:  # noqa: BLE001 - reported below, with the target's name
            out[t.name] = {"error": str(e)}

    threads = [threading.Thread(target=one, args=(t,)) for t in targets]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for name, r in out.items():
        if "error" in r:
            raise SystemExit(f"{name}: {w.name} failed: {r['error']}")
    return out


def one_round(i: int, eps: list[dict], workdir: Path, cpus_up: str, cpus_proxy: str, args: argparse.Namespace,
              base: Path | None) -> dict:
    """The routers started afresh (the first to start alternating), warmed, then ``repeat`` samples a figure."""
    names = TARGETS + ((BASE,) if base is not None else ())
    order = names if i % 2 == 0 else names[::-1]
    targets: list[run.Target] = []
    try:
        for name in order:
            env = {"PYTHONPATH": str(base / "agent")} if name == BASE else None
            targets.append(run.start_llmgw_key(name, eps, workdir, cpus_proxy, name != KEY, env))
        for t in targets:
            run.warm(t, cpus_up)
        got: dict = {"first": order[0], "samples": {}}
        for f in FIGURES:
            w = f.load(args.duration, args.warmup, args.rate_scale)
            got["samples"][f.workload] = [sample(side_by_side(targets, w, cpus_up), f) for _ in range(args.repeat)]
        got["load"] = os.getloadavg()[0]
        return got
    finally:
        for t in targets:
            t.proc.stop()


def sample(res: dict[str, dict], f: Figure) -> dict:
    """One side-by-side sample: each target's figure and the rate it was served at."""
    return {name: {"us": r[f.key], "rps": r["rps"], "ok": r["ok"], "errors": sum(r["errors"].values())}
            for name, r in res.items()}


def ratios(samples: list[dict], target: str = LIMITED) -> list[float]:
    return [s[target]["us"] / s[KEY]["us"] for s in samples]


def report(saved: dict, micro: list[dict] | None) -> str:
    rounds, a = saved["rounds"], saved["args"]
    scale, base = a.get("rate_scale", 1.0), a.get("base")
    lines = ["# What per-key limits cost the router", "",
             f"`llmgw-1w-limits` (the client's key limited on all six dimensions, none reached) against "
             f"`llmgw-1w-key` (the same key, no limits), both this tree's router, 1 worker each on the CPU kept "
             f"for the proxy; simulator and load generators on the other. Each sample runs both at once, each "
             f"sent the same fixed schedule by a load generator of its own ({a['duration']:g} s measured after "
             f"{a['warmup']:g} s of warm-up), CPU from `/proc/<pid>/stat` over the window; {len(rounds)} rounds "
             f"of {a['repeat']} samples a figure, the routers started afresh each round. A round's ratio is "
             "the median of its samples' ratios (limits over key); the load average, taken at each round's "
             "end, counts the benchmark's own processes."
             + (f" `{BASE}` is the router of `{base}` with the same limited key, measured at the same moments."
                if base else ""), "",
             "| round | key µs/request | limits µs/request | ratio | key µs/chunk | limits µs/chunk | ratio "
             "| served rate, lowest/set | load average |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [round_row(i, r, scale) for i, r in enumerate(rounds, 1)]
    lines += ["", "| figure | target | measured: median ratio (range over rounds) | every sample's range | met |",
              "|---|---|---|---|---|"]
    for f in FIGURES:
        judged = [st.median(ratios(r["samples"][f.workload])) for r in rounds]
        lines.append(f"| {f.label(scale)}, limits on against off | ≤ {TARGET:.2f}x | {spread(judged)} | "
                     f"{every(rounds, f)} | {'yes' if st.median(judged) <= TARGET else 'no'} |")
    if base:
        lines += base_rows(rounds, scale, base)
    if micro:
        lines += ["", "## Where the difference goes: the limited path's steps, in process", "",
                  "The router's own code (`benchmarks/router/limits_path.py`): each step of a limited "
                  "request against what a key-only request does in its place, CPU time of one process "
                  "(`time.process_time`), the collector tuned and the loop chosen as the router does.", ""]
        lines += limits_path.table(micro, saved["micro_n"])
    return "\n".join(lines) + "\n"


def round_row(i: int, r: dict, scale: float) -> str:
    """One round: each figure's median µs for both targets and their median ratio; the slowest schedule kept."""
    cells, served = [], []
    for f in FIGURES:
        s = r["samples"][f.workload]
        cells += [f"{st.median(x[KEY]['us'] for x in s):.1f}", f"{st.median(x[LIMITED]['us'] for x in s):.1f}",
                  f"{st.median(ratios(s)):.3f}"]
        served.append(min(v["rps"] for x in s for v in x.values()) / (f.rate * scale))
    return f"| {i} | " + " | ".join(cells) + f" | {min(served):.3f} | {r['load']:.1f} |"


def every(rounds: list[dict], f: Figure, target: str = LIMITED) -> str:
    xs = [x for r in rounds for x in ratios(r["samples"][f.workload], target)]
    return f"{min(xs):.3f}-{max(xs):.3f}"


def base_rows(rounds: list[dict], scale: float, base: str) -> list[str]:
    """REV's limited router against the same key-only one, and this tree's limited router against REV's."""
    lines = ["", f"| figure | `{base}`, limits on against off | this tree's limited router against `{base}`'s |",
             "|---|---|---|"]
    for f in FIGURES:
        theirs = [st.median(ratios(r["samples"][f.workload], BASE)) for r in rounds]
        ours = [st.median(x[LIMITED]["us"] / x[BASE]["us"] for x in r["samples"][f.workload]) for r in rounds]
        lines.append(f"| {f.label(scale)} | {spread(theirs)} | {spread(ours)} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3, help="side-by-side samples of each figure a round")
    ap.add_argument("--duration", type=float, default=6.0, help="measured seconds a sample")
    ap.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds of the same load first")
    ap.add_argument("--micro-n", type=int, default=20_000, help="requests a repeat of the in-process steps")
    ap.add_argument("--micro-repeat", type=int, default=7)
    ap.add_argument("--rate-scale", type=float, default=1.0, help="every figure's rate times this")
    ap.add_argument("--base", metavar="REV", help="add REV's router with the limited key, measured at the same moments")
    ap.add_argument("--quick", action="store_true", help="one round of one short sample (a smoke test)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "router-limits"))
    ap.add_argument("--report-only", metavar="JSON", help="rebuild the .md from an earlier .json")
    args = ap.parse_args()
    out = Path(args.out)
    if args.report_only:
        saved = json.loads(Path(args.report_only).read_text())
        write(out.with_suffix(".md"), report(saved, saved.get("micro")))
        return 0
    if args.quick:
        args.rounds, args.repeat, args.duration, args.warmup, args.micro_n, args.micro_repeat = 1, 1, 1.0, 0.5, 500, 2
    saved = {"args": {k: getattr(args, k) for k in ("rounds", "repeat", "duration", "warmup", "rate_scale", "base")},
             "figures": [f.__dict__ for f in FIGURES], "rounds": measure_rounds(args), "micro_n": args.micro_n}
    print("in-process steps", file=sys.stderr, flush=True)
    saved["micro"] = limits_path.measure(args.micro_n, args.micro_repeat)
    write(out.with_suffix(".json"), json.dumps(saved, indent=1) + "\n")
    write(out.with_suffix(".md"), report(saved, saved["micro"]))
    return 0


def measure_rounds(args: argparse.Namespace) -> list[dict]:
    """Every round, on one simulator; the proxy's CPU is the last allowed one, as in ``run.py``."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        raise SystemExit("needs two CPUs: one for the routers, one for the simulator and load generators")
    cpus_up, cpus_proxy = ",".join(map(str, allowed[:-1])), str(allowed[-1])
    os.sched_setaffinity(0, set(allowed[:-1]))  # this process's reads of /proc stay off the routers' CPU
    procs: list[run.Proc] = []
    with tempfile.TemporaryDirectory(prefix="llmgw-limits-cost-") as tmp:
        workdir = Path(tmp)
        base = export(args.base, workdir / "base") if args.base else None
        try:
            fast_p, fast = run.start_sim("fast", {}, workdir, cpus_up)
            procs.append(fast_p)
            eps = [{"id": "fast0", "model": "fast", "url": fast}]
            rounds = []
            for i in range(args.rounds):
                print(f"round {i + 1}/{args.rounds}", file=sys.stderr, flush=True)
                rounds.append(one_round(i, eps, workdir, cpus_up, cpus_proxy, args, base))
            return rounds
        finally:
            for p in procs:
                p.stop()


if __name__ == "__main__":
    sys.exit(main())
