"""Placement decisions per second over fleets of 1k, 5k and 10k 8-GPU nodes, before and after.

    .venv/bin/python benchmarks/placement/run.py [--sizes 1000 5000 10000] [--runs 3]
        [--decisions 20000] [--baseline main] [--no-write]

One decision is one replica placed (or refused): the placement call plus
marking its GPUs busy.  The fleet is half HGX H100 boards (NVSwitch, every
pair NV18) and half 8-GPU PCIe boxes whose bridges pair (0,1)(2,3)(4,5)(6,7)
over two sockets (tests/fixtures/hardware), all GPUs free at the start.
Requests come from a fixed random stream: TP 1, 2, 4 or 8 with weights that
fit; when a request cannot be placed, or the fleet is 80% busy, the oldest
replicas are stopped (their GPUs released) until it fits, so the run reaches
and holds a steady, fragmented state rather than only filling an empty fleet.

* ``after``: ``PlacementIndex`` of this tree (``index.place`` + ``index.take``,
  ``index.release`` on stop);
* ``scan``: ``place()`` of this tree over every node (what ``ctl explain`` runs),
  to show what the index saves over the new scoring itself;
* ``before``: ``place()`` of the baseline ref (default ``main``, extracted with
  ``git archive`` and run from there), over the list of every node as the
  reconciler passes it, each decision rebuilding that node's free set.  It is
  far slower, so it runs for a fixed time (``--before-seconds``) rather than a
  fixed number of decisions; its rate is what matters.

Each variant runs in its own Python process; its CPU time (user + system) is
read with ``time.process_time()`` around the decision loop, apart from building the
fleet, which is reported separately.  Every figure is the median of
``--runs`` runs, with the spread.  Writes benchmarks/results/placement.json
and placement.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
HARDWARE = REPO / "tests" / "fixtures" / "hardware"
BOXES = ("hgx-h100-nvswitch-topology.yaml", "pcie-8gpu-bridged-2socket.yaml")
TARGET = 10_000  # decisions per second at 10,000 nodes
GIB = 1 << 30


# --- the worker (runs in its own process, against one tree) ------------------


def requests(seed: int):
    from llmgw.catalog import Model, Profile
    from llmgw.placement import PlacementRequest

    rng = random.Random(seed)
    model = Model(name="m", source="/models/m", served_name="m")
    profiles = {tp: Profile(name=f"tp{tp}", engine="vllm", tensor_parallel_size=tp) for tp in (1, 2, 4, 8)}
    while True:
        tp = rng.choice((1, 1, 1, 2, 2, 4, 8))
        yield PlacementRequest(model=model, profile=profiles[tp], weights_bytes=int(rng.uniform(5, 30) * tp * GIB),
                               memory_headroom=0.2)


def fleet(n: int):
    import yaml

    from llmgw.hardware.types import HardwareInventory
    from llmgw.placement import NodeCapacity

    docs = [yaml.safe_load((HARDWARE / b).read_text()) for b in BOXES]
    out = []
    for i in range(n):
        doc = dict(docs[i % 2], node_id=f"node-{i:05d}")
        inv = HardwareInventory.from_dict(doc)
        out.append(NodeCapacity(inventory=inv, free_gpus=frozenset(g.index for g in inv.gpus)))
    return out


def work(variant: str, n: int, decisions: int, seconds: float, seed: int) -> dict:
    from dataclasses import replace

    t0, c0 = time.perf_counter(), time.process_time()
    nodes = fleet(n)
    total_gpus = 8 * n
    if variant == "after":
        from llmgw.placement import PlacementIndex

        index = PlacementIndex(nodes)
    else:
        from llmgw.placement import place

        current = {c.node_id: c for c in nodes}
    build_wall, build_cpu = time.perf_counter() - t0, time.process_time() - c0

    running: list = []  # placements, oldest first
    busy = 0
    placed = refused = stopped = 0

    def stop_oldest() -> None:
        nonlocal busy, stopped
        p = running.pop(0)
        for s in p.shards:
            if variant == "after":
                index.release(s.node_id, s.gpu_indices)
            else:
                node = current[s.node_id]
                current[s.node_id] = replace(node, free_gpus=node.free_gpus | frozenset(s.gpu_indices))
            busy -= len(s.gpu_indices)
        stopped += 1

    stream = requests(seed)
    t0, c0 = time.perf_counter(), time.process_time()
    done = 0
    while done < decisions and (variant == "after" or time.perf_counter() - t0 < seconds):
        req = next(stream)
        while busy > 0.8 * total_gpus:
            stop_oldest()
        if variant == "after":
            result = index.place(req)
        else:
            result = place(req, list(current.values()))
        done += 1
        if result.placement is None:
            refused += 1
            if running:
                stop_oldest()
            continue
        placed += 1
        if variant == "after":
            index.take(result.placement)
        else:
            for s in result.placement.shards:
                node = current[s.node_id]
                current[s.node_id] = replace(node, free_gpus=node.free_gpus - frozenset(s.gpu_indices))
        busy += sum(len(s.gpu_indices) for s in result.placement.shards)
        running.append(result.placement)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"variant": variant, "nodes": n, "decisions": done, "placed": placed, "refused": refused,
            "stopped": stopped, "wall_s": wall, "cpu_s": cpu, "per_s_wall": done / wall, "per_s_cpu": done / cpu,
            "build_wall_s": build_wall, "build_cpu_s": build_cpu, "busy_at_end": busy / total_gpus}


# --- the driver ----------------------------------------------------------------


def baseline_tree(ref: str, tmp: Path) -> Path:
    """The baseline's agent/ package, extracted with git archive."""
    archive = tmp / "base.tar"
    subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(archive), ref, "agent"], check=True)
    with tarfile.open(archive) as t:
        t.extractall(tmp / "base", filter="data")
    return tmp / "base" / "agent"


def run_variant(code: Path, variant: str, n: int, decisions: int, seconds: float, seed: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(code))
    res = subprocess.run([sys.executable, __file__, "--worker", variant, str(n), str(decisions), str(seconds),
                          str(seed)], env=env, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"{variant} at {n} nodes failed:\n{res.stderr}")
    return json.loads(res.stdout)


def spread(values: list[float]) -> str:
    return f"{min(values):,.0f}–{max(values):,.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 5000, 10000])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--decisions", type=int, default=20000)
    ap.add_argument("--before-seconds", type=float, default=10.0)
    ap.add_argument("--baseline", default="main")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if args.worker:
        variant, n, decisions, seconds, seed = args.worker
        print(json.dumps(work(variant, int(n), int(decisions), float(seconds), int(seed))))
        return

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = baseline_tree(args.baseline, Path(tmp))
        for n in args.sizes:
            for r in range(args.runs):
                for variant, code in (("after", REPO / "agent"), ("scan", REPO / "agent"), ("before", base)):
                    row = run_variant(code, variant, n, args.decisions, args.before_seconds, seed=r)
                    row["run"] = r
                    rows.append(row)
                    print(f"{variant:6} {n:6} nodes run {r}: {row['decisions']:6} decisions, "
                          f"{row['per_s_cpu']:10,.0f}/s CPU, {row['per_s_wall']:10,.0f}/s wall, "
                          f"build {row['build_cpu_s']:.2f} s CPU", flush=True)
    summary = []
    for n in args.sizes:
        entry = {"nodes": n}
        for variant in ("after", "scan", "before"):
            mine = [x for x in rows if x["nodes"] == n and x["variant"] == variant]
            entry[variant] = {
                "per_s_cpu_median": statistics.median(x["per_s_cpu"] for x in mine),
                "per_s_cpu_spread": [min(x["per_s_cpu"] for x in mine), max(x["per_s_cpu"] for x in mine)],
                "per_s_wall_median": statistics.median(x["per_s_wall"] for x in mine),
                "per_s_wall_spread": [min(x["per_s_wall"] for x in mine), max(x["per_s_wall"] for x in mine)],
                "build_cpu_s_median": statistics.median(x["build_cpu_s"] for x in mine),
                "decisions": [x["decisions"] for x in mine],
            }
        entry["ratio_cpu"] = entry["after"]["per_s_cpu_median"] / entry["before"]["per_s_cpu_median"]
        summary.append(entry)
    doc = {
        "python": platform.python_version(),
        "machine": f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end",
        "baseline": subprocess.run(["git", "-C", str(REPO), "rev-parse", args.baseline], capture_output=True,
                                   text=True).stdout.strip(),
        "after": subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                                text=True).stdout.strip(),
        "args": {k: v for k, v in vars(args).items() if k != "worker"},
        "summary": summary,
        "runs": rows,
    }
    print(json.dumps(summary, indent=2))
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "placement.json").write_text(json.dumps(doc, indent=2) + "\n")
        (RESULTS / "placement.md").write_text(render(doc))


def render(doc: dict) -> str:
    lines = [
        "# Placement decisions per second at 1k, 5k and 10k nodes",
        "",
        "`benchmarks/placement/run.py` (see its docstring for the workload): one decision is one replica placed or",
        "refused, plus marking its GPUs busy; half HGX H100 boards, half 8-GPU PCIe boxes with bridged pairs over",
        "two sockets; TP 1/2/4/8 with weights that fit; the oldest replicas stop when the fleet is 80% busy or a",
        "request does not fit. `after` is `PlacementIndex` of this tree, `scan` this tree's `place()`, `before` `place()` of the baseline",
        f"(`{doc['args']['baseline']}`, {doc['baseline'][:12]}) over every node, in the same run. Rates are per CPU",
        "second of the process (``time.process_time()``; the machine is shared, so CPU time is the steadier figure)",
        f"and per wall second; medians of {doc['args']['runs']} runs, spread min–max. Python {doc['python']},",
        f"{doc['machine']}. Raw figures: `benchmarks/results/placement.json`.",
        "",
        "## Targets",
        "",
        "| target | measured | met |",
        "|---|---:|---|",
    ]
    for e in doc["summary"]:
        if e["nodes"] == 10000:
            got = e["after"]["per_s_cpu_median"]
            lines.append(f"| ≥ {TARGET:,} decisions/s at 10,000 nodes (CPU) | {got:,.0f} | "
                         f"{'yes' if got >= TARGET else 'no'} |")
            wall = e["after"]["per_s_wall_median"]
            lines.append(f"| ≥ {TARGET:,} decisions/s at 10,000 nodes (wall) | {wall:,.0f} | "
                         f"{'yes' if wall >= TARGET else 'no'} |")
    lines += [
        "",
        "## Decisions per second",
        "",
        "| nodes | after, CPU (spread) | after, wall (spread) | scan, CPU (spread) | before, CPU (spread) | before, wall (spread) | after / before (CPU) | index build, CPU s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e in doc["summary"]:
        a, b, sc = e["after"], e["before"], e["scan"]
        lines.append(
            f"| {e['nodes']:,} | {a['per_s_cpu_median']:,.0f} ({spread(a['per_s_cpu_spread'])}) | "
            f"{a['per_s_wall_median']:,.0f} ({spread(a['per_s_wall_spread'])}) | "
            f"{sc['per_s_cpu_median']:,.1f} ({sc['per_s_cpu_spread'][0]:,.1f}–{sc['per_s_cpu_spread'][1]:,.1f}) | "
            f"{b['per_s_cpu_median']:,.1f} ({b['per_s_cpu_spread'][0]:,.1f}–{b['per_s_cpu_spread'][1]:,.1f}) | "
            f"{b['per_s_wall_median']:,.1f} ({b['per_s_wall_spread'][0]:,.1f}–{b['per_s_wall_spread'][1]:,.1f}) | "
            f"{e['ratio_cpu']:,.0f}x | {a['build_cpu_s_median']:.2f} |")
    lines += [
        "",
        "`scan` and `before` run for a fixed time, so they make far fewer decisions (counts in the JSON); their",
        "fleet is emptier at the end, which favours them. `scan` is this tree's `place()` over every node (what",
        "`llmgw ctl explain` runs): it explains every node, so it is not meant for the reconciler at scale. Building the index (and the fleet's inventories) is done once and",
        "is not in the rates; the reconciler would keep the index between passes or rebuild it per pass",
        "(the build column).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
