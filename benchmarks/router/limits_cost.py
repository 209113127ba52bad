#!/usr/bin/env python3
"""What per-key limits cost the router: CPU per request and per chunk, limited key against the same key unlimited.

Both routers are this tree's, started by ``run.py --limits`` beside each other: ``llmgw-1w-key``
(the load generator's key configured, no ``limits``) and ``llmgw-1w-limits`` (the same key
limited on all six dimensions, none reached, so every request is reserved, settled from the
engine's usage and answered with the rate-limit headers; streams ask for and strip the usage
event). Rounds repeat the pair and each round's repeats alternate the two targets, so the drift
of a shared machine falls on both; the judged figure is the median of the rounds' ratios.

    python benchmarks/router/limits_cost.py [--rounds 6] [--repeat 3]

Writes ``<out>.json`` (every repeat) and ``<out>.md`` (per-round figures, the ratios with their
spread, and whether the 10 % target is met).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics as st
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from ab import spread, write  # noqa: E402

TARGETS = ("llmgw-1w-key", "llmgw-1w-limits")
FIGURES = (("small-c16", "proxy_cpu_per_request_us", "CPU per request (small-c16: 1 token, not streamed)"),
           ("stream-64", "proxy_cpu_per_chunk_us", "CPU per chunk (stream-64: 64 chunks a stream)"))
TARGET = 1.10


def run_once(out: Path, repeat: int, quick: bool) -> dict:
    """One round of ``run.py``: each figure's repeats for both targets."""
    argv = [sys.executable, str(HERE / "run.py"), "--limits", "--only", ",".join(TARGETS),
            "--workloads", ",".join(w for w, _, _ in FIGURES), "--layout", "isolated",
            "--repeat", str(repeat), "--out", str(out)] + (["--quick"] if quick else [])
    subprocess.run(argv, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    runs = json.loads(out.with_suffix(".json").read_text())["runs"]
    got: dict = {"load": os.getloadavg()[0]}
    for w, key, _ in FIGURES:
        for t in TARGETS:
            r = runs[w][t]
            if "error" in r:
                raise SystemExit(f"{t}: {w} failed: {r['error']}")
            got[f"{t}/{w}"] = r.get("repeats", [r[key]])
    return got


def report(rounds: list[dict], repeat: int) -> str:
    lines = ["# What per-key limits cost the router", "",
             f"`llmgw-1w-limits` (the client's key limited on all six dimensions, none reached) against "
             f"`llmgw-1w-key` (the same key, no limits), both this tree's router, 1 worker on a CPU of its own; "
             f"{len(rounds)} rounds of {repeat} repeats each, the two targets alternating within a round; "
             "medians of each round's repeats. The load average counts the benchmark's own processes.", "",
             "| round | key µs/request | limits µs/request | ratio | key µs/chunk | limits µs/chunk | ratio "
             "| load average |", "|---|---|---|---|---|---|---|---|"]
    ratios: dict[str, list[float]] = {w: [] for w, _, _ in FIGURES}
    for i, r in enumerate(rounds, 1):
        cells = []
        for w, _, _ in FIGURES:
            a, b = st.median(r[f"{TARGETS[0]}/{w}"]), st.median(r[f"{TARGETS[1]}/{w}"])
            ratios[w].append(b / a)
            cells += [f"{a:.1f}", f"{b:.1f}", f"{b / a:.3f}"]
        lines.append(f"| {i} | " + " | ".join(cells) + f" | {r['load']:.1f} |")
    lines += ["", "| figure | target | measured: median ratio (range over rounds) | met |", "|---|---|---|---|"]
    for w, _, what in FIGURES:
        med = st.median(ratios[w])
        lines.append(f"| {what}, limits on against off | ≤ {TARGET:.2f}x | {spread(ratios[w])} | "
                     f"{'yes' if med <= TARGET else 'no'} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--full", action="store_true", help="run.py's full 8 s windows instead of --quick's 3 s")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "router-limits"))
    ap.add_argument("--report-only", metavar="JSON", help="rebuild the .md from an earlier .json")
    args = ap.parse_args()
    out = Path(args.out)
    if args.report_only:
        saved = json.loads(Path(args.report_only).read_text())
        write(out.with_suffix(".md"), report(saved["rounds"], saved["repeat"]))
        return 0
    rounds = []
    with tempfile.TemporaryDirectory(prefix="llmgw-limits-cost-") as tmp:
        for i in range(args.rounds):
            print(f"round {i + 1}/{args.rounds}", file=sys.stderr, flush=True)
            rounds.append(run_once(Path(tmp) / f"round-{i}", args.repeat, not args.full))
    write(out.with_suffix(".json"), json.dumps({"repeat": args.repeat, "full": args.full, "rounds": rounds},
                                               indent=1) + "\n")
    write(out.with_suffix(".md"), report(rounds, args.repeat))
    return 0


if __name__ == "__main__":
    sys.exit(main())
