#!/usr/bin/env python3
"""The router of two commits side by side: CPU per request and per chunk, one upstream, one harness.

A change to the router is judged against the router before it, and nothing else may differ:
the engine simulator's speed changes the router's CPU per request (fewer requests per
event-loop wake cost more each; docs/router.md), and a newer harness may write settings an
older router refuses. So both trees are exported from git, the candidate's simulator is
replaced by the baseline's (``--sim``), both run under the baseline's harness, and rounds
alternate baseline and candidate so drift of a shared machine falls on both.

    python benchmarks/router/ab.py --base 3e24d90^ [--head HEAD] [--rounds 6]

Writes ``<out>.json`` (every repeat) and ``<out>.md`` (per-round figures, medians, the
candidate/baseline ratios with their spread, and whether the 5 % target is met).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics as st
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = ("small-c16", "stream-64")
TARGET = 1.05


def export(rev: str, dest: Path) -> Path:
    """``rev``'s tree (its agent/ and benchmarks/) under ``dest``, as committed."""
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "agent", "benchmarks"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def run_once(harness: Path, code: Path, out: Path, repeat: int) -> dict:
    """One run of the baseline's harness against the router in ``code``; its JSON."""
    env = {**os.environ, "PYTHONPATH": str(code / "agent")}
    subprocess.run([sys.executable, str(harness / "benchmarks/router/run.py"), "--quick", "--only", "llmgw-1w",
                    "--workloads", ",".join(WORKLOADS), "--layout", "isolated", "--repeat", str(repeat),
                    "--out", str(out)], env=env, check=True, cwd=harness, stdout=subprocess.DEVNULL)
    runs = json.loads(out.with_suffix(".json").read_text())["runs"]
    req, chunk = runs["small-c16"]["llmgw-1w"], runs["stream-64"]["llmgw-1w"]
    for w, r in (("small-c16", req), ("stream-64", chunk)):
        if "error" in r:
            raise SystemExit(f"{code.name}: {w} failed: {r['error']}")
    return {"per_request_us": req.get("repeats", [req["proxy_cpu_per_request_us"]]),
            "per_chunk_us": chunk.get("repeats", [chunk["proxy_cpu_per_chunk_us"]]), "rps": req.get("rps"),
            "load": os.getloadavg()[0]}


def spread(xs: list[float]) -> str:
    return f"{st.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def report(rounds: list[dict], args: argparse.Namespace) -> str:
    lines = [f"# Router A/B: {args.head} against {args.base}", "",
             f"Simulator of `{args.sim or args.base}` for both, harness of `{args.base}`, "
             f"{len(rounds)} interleaved rounds of {args.repeat} repeats; medians of each round's repeats. "
             "The load average counts the benchmark's own three processes (about 2 on a quiet machine).", "",
             "| round | base µs/request | head µs/request | ratio | base µs/chunk | head µs/chunk | ratio | load average |",
             "|---|---|---|---|---|---|---|---|"]
    ratios: dict[str, list[float]] = {"per_request_us": [], "per_chunk_us": []}
    for i, r in enumerate(rounds, 1):
        cells = []
        for key in ratios:
            b, h = st.median(r["base"][key]), st.median(r["head"][key])
            ratios[key].append(h / b)
            cells += [f"{b:.2f}", f"{h:.2f}", f"{h / b:.3f}"]
        lines.append(f"| {i} | " + " | ".join(cells) + f" | {r['head']['load']:.1f} |")
    lines += ["", "| figure | target | measured: median ratio (range) | met |", "|---|---|---|---|"]
    for key, what in (("per_request_us", "CPU per request (small-c16)"), ("per_chunk_us", "CPU per chunk (stream-64)")):
        med = st.median(ratios[key])
        lines.append(f"| {what} | ≤ {TARGET:.2f}x | {spread(ratios[key])} | {'yes' if med <= TARGET else 'no'} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", help="the baseline router's commit (required unless --report-only)")
    ap.add_argument("--head", default="HEAD", help="the candidate's commit (default HEAD)")
    ap.add_argument("--sim", help="whose engine simulator both use (default: --base)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "router-ab"))
    ap.add_argument("--report-only", metavar="JSON", help="rebuild the .md from an earlier .json")
    args = ap.parse_args()
    out = Path(args.out)
    if args.report_only:
        saved = json.loads(Path(args.report_only).read_text())
        args.base, args.head, args.sim = saved["base"], saved["head"], saved["sim"]
        args.repeat = saved.get("repeat", args.repeat)
        write(out.with_suffix(".md"), report(saved["rounds"], args))
        return 0
    if not args.base:
        ap.error("--base is required")
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-ab-"))
    try:
        base = export(args.base, tmp / "base")
        head = export(args.head, tmp / "head")
        sim = export(args.sim, tmp / "sim") if args.sim else base
        shutil.rmtree(head / "agent/llmgw/sim")
        shutil.copytree(sim / "agent/llmgw/sim", head / "agent/llmgw/sim")
        rounds = []
        for i in range(args.rounds):
            r = {}
            for name, code in (("base", base), ("head", head)):
                print(f"round {i + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
                r[name] = run_once(base, code, tmp / f"{name}-{i}", args.repeat)
            rounds.append(r)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write(out.with_suffix(".json"), json.dumps({"base": args.base, "head": args.head, "sim": args.sim or args.base,
                                                "repeat": args.repeat, "rounds": rounds}, indent=1) + "\n")
    write(out.with_suffix(".md"), report(rounds, args))
    return 0


def write(path: Path, text: str) -> None:
    """Whole or not at all: a results file is never left half written under its name."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
