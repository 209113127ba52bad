"""Cache-aware routing on a QPS ladder past saturation, through a fleet's real processes.

    PYTHONPATH=agent .venv/bin/python benchmarks/routing/ladder.py            # the full form (about 14 min here)
    PYTHONPATH=agent .venv/bin/python benchmarks/routing/ladder.py --quick    # under a minute

A control plane, an agent and ``--replicas`` engine simulators it launches
(``tests/integration/fleet.py``; the profile has ``kv_events``, so every engine publishes its
KV events and the agent relays them as route keys), and a standalone ``llmgw router``
on the control plane's watch, one per scorer: least-outstanding, prefix affinity (the
approximate scorer) and cache-aware (fed by the route keys). The same seeded workload
(``ladder_workload``: groups sharing a long system prompt, several users each, multi-turn) goes
through each router in turn as open-loop Poisson load from the ``openai`` client
(``ladder_load``), on a ladder of rates from well below saturation to past it, every answer
drained between rates; each scorer's ladder runs on a fleet of its own, started
for it, so every engine's prefix cache starts empty.

The engines' timing is the simulator's model (``LLMGW_SIM_*``, stated in the report): a
prompt's uncached tokens cost prefill time, one prompt at a time per engine, so saturation
comes from the prefill the engines' prefix caches do not save, in simulated time, not from this
machine's CPU; the report gives each process's CPU share at the top rate to show whether that
holds.

Per scorer and rate: TTFT p50/p90, output tokens/s, requests and errors, the engines' own
prefix-cache hit rate (deltas of their /metrics), the router's CPU per request (/proc), and
whether the queue grew through the run (saturation). Writes ``<out>.json`` (every figure and
setting) and ``<out>.md`` with the issue's targets.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "integration"), str(HERE), str(ROOT / "benchmarks" / "disagg")]

import fleet as harness  # noqa: E402
from fleet import Fleet, router_endpoints, standalone_router  # noqa: E402
from llmgw.durable import write_atomic  # noqa: E402
from tests.support import procfs  # noqa: E402
from tests.support.polling import until  # noqa: E402
from tests.support.scrape import scrape  # noqa: E402

import ladder_load  # noqa: E402
import ladder_report as report  # noqa: E402
from ladder_workload import Conversations, Shape  # noqa: E402
from poisson_load import arrivals  # noqa: E402

MODEL = "tiny"  # the fleet harness's model
CORES = os.cpu_count() or 1
BLOCK = 16
# One prompt token's prefill, one generated token alone, the slowdown per other running request;
# chosen (not fitted): see SCALE.
KNOBS = {"LLMGW_SIM_PREFILL_TOKEN_LATENCY": "0.0005", "LLMGW_SIM_TOKEN_LATENCY": "0.02",
         "LLMGW_SIM_DECODE_BATCH_SLOWDOWN": "0.005", "LLMGW_SIM_PREFILL_INTERFERENCE": "1"}
SCALE = ("llm-d's 73-capacity run (8 replicas of Qwen3-32B with 307,328 KV tokens each; 150 groups of a "
         "6,000-token system prompt, 5 users each with 1,200-token questions, 1,000 output tokens) with every "
         "prompt length divided by 5 and each prompt token's prefill cost multiplied by 5 (0.5 ms: a 6,000-token "
         "prompt of the original at 10k tokens/s takes the 0.6 s its 1,200-token counterpart takes here), so "
         "requests take the original's seconds and the rates stay in its range; a third of the groups (50), "
         "so that stages of seconds, not minutes, see each group more than once, and the KV cache divided by "
         "15 (5 for the tokens, 3 for the groups: 20,480 tokens) so that the system prompts still overfill a "
         "replica 2.9 times over when every replica sees every group and fill 37 % of it when each group keeps "
         "to one, as in the original; answers divided by 10 (100 tokens, 20 ms each) because every streamed "
         "token costs CPU in the engine, the router and the client, which share 2 cores with the control plane "
         "and the agent. 8 replicas and 5 users a group, as the original.")
FULL = dict(replicas=8, groups=50, users=5, turns=3, system=1200, question=240, answer=100, kv_blocks=1281,
            rates=[3.0, 6.0, 9.0, 12.0, 18.0, 24.0], duration=12.0, repeat=2, warmup=10.0)
QUICK = dict(replicas=4, groups=24, users=3, turns=3, system=400, question=80, answer=16, kv_blocks=251,
             rates=[8.0], duration=6.0, repeat=1, warmup=0.0)
WARMUP_RATE = 10.0
QUICK_SCALE = ("the quick form: 4 engines of 4,000 KV tokens, 24 groups of a 400-token system prompt, 3 users, "
               "16-token answers, one rate: enough for every scorer to run and the hit rates to part, not "
               "for latency figures.")
SCORERS = {"least-outstanding": {}, "prefix-affinity": {"scorer": "prefix-affinity"},
           "cache-aware": {"scorer": "prefix-affinity", "cache_aware": {"models": [MODEL]}}}
NOTES = [
    "Saturation is the engines' prefill lanes full in simulated time (a prompt's uncached tokens at the "
    "stated cost, one prompt at a time per engine), so it moves with the hit rate a scorer earns: the fewer "
    "tokens the prefix caches save, the lower the rate at which the queue starts to grow.",
    "A saturated run's TTFT grows with the run's length (the queue builds for as long as arrivals last), so "
    "its absolute TTFT p90 says as much about the arrival window as about the scorer; the ratios between "
    "scorers at the same rate and window are what compare.",
    "The router's CPU per request is its process's CPU over the run divided by the requests: its background "
    "work (the watch, load reports) and its access log line per request included, so it is highest at the "
    "lowest rate; the cache-aware router adds the simulator tokenizer and the block hashing of each prompt.",
    "Client, router, engines, control plane and agent share one small machine: the CPU table says how busy "
    "each was at the top rate. A process near 1.0 (one core) or a machine near its core count would add "
    "scheduling delay that the simulated timing does not model. The whole-machine column counts every "
    "process on it, other work included; the columns before it are this benchmark's own.",
]


def _quiet_harness() -> None:
    """The harness runs its processes at DEBUG for tests' diagnostics (the control plane logs every
    route-key message there); a benchmark measures them at the level an operator runs."""
    harness.llmgw_argv = lambda *args: [sys.executable, "-m", "llmgw", "--log-level", "INFO", *args]


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    total = sum(fields[:8])
    return total - fields[3] - fields[4], total


class Bench:
    """One scorer's fleet: a control plane, an agent, its engines (addresses and processes), the router."""

    def __init__(self, workdir: Path, a: argparse.Namespace, scorer: str) -> None:
        self.scorer = scorer
        env = {**KNOBS, "LLMGW_SIM_PREFIX_CACHE_BLOCKS": str(a.kv_blocks)}
        self.fleet = Fleet(workdir, nodes={"a": a.replicas}, replicas=a.replicas,
                           profile={"kv_events": not a.no_route_keys, "env": env, "start_timeout": 120})
        self.fleet.start()
        ready = self.fleet.wait_ready(a.replicas, timeout=180)
        self.engines = {r["replica_id"]: "http://127.0.0.1:%d" % next(s["port"] for s in r["shards"] if s["rank"] == 0)
                        for r in ready}
        self.engine_pids = self.fleet.engine_pids()
        assert len(self.engine_pids) == a.replicas, self.engine_pids
        self.router, port = standalone_router(self.fleet, name="router", extra={"balancing": SCORERS[scorer]})
        self.url = f"http://127.0.0.1:{port}"
        until(lambda: router_endpoints(port) == a.replicas, f"the {scorer} router to see every replica",
              timeout=60, on_timeout=self.router.output)
        if scorer == "cache-aware" and not a.no_route_keys:  # its index speaks for every replica from the start
            until(lambda: set(httpx.get(f"{self.url}/healthz", timeout=30).json().get("route_keys", {})
                              .get("replicas", {})) == set(self.engines),
                  "the router's index to hold every replica's feed", timeout=60, on_timeout=self.router.output)

    def counters(self) -> dict[str, float]:
        """The engines' prefix-cache hits and queries so far; the requests the index placed (cache-aware)."""
        hits = queries = 0.0
        for url in self.engines.values():
            c = scrape(url, ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"))
            hits += c["vllm:prefix_cache_hits_total"]
            queries += c["vllm:prefix_cache_queries_total"]
        out = {"hits": hits, "queries": queries}
        if self.scorer == "cache-aware":
            out["placed_by_index"] = scrape(self.url, ("llmgw_router_cache_predictions_total",),
                                            f'model="{MODEL}"')["llmgw_router_cache_predictions_total"]
        return out

    def cpu(self) -> dict[str, Any]:
        """CPU seconds so far: the router's, each engine's, the control plane's and agent's, this
        process's (the client), and the whole machine's busy and total jiffies."""
        f = self.fleet
        busy, total = machine_cpu()
        return {"router": procfs.tree_cpu_seconds(self.router.pid),
                "engines": [procfs.tree_cpu_seconds(p) for p in self.engine_pids],
                "control": procfs.tree_cpu_seconds(f.server.pid) + sum(
                    procfs.cpu_seconds(a.pid) or 0.0 for a in f.agents.values()),
                "client": procfs.cpu_seconds("self") or 0.0, "busy": busy, "total": total}

    def close(self) -> None:
        self.fleet.close()


def measure(bench: Bench, rate: float, requests: list[tuple[int, int, str]], times: list[float],
            a: argparse.Namespace) -> dict[str, Any]:
    """One rate of the ladder through the bench's router: the client's records and what the processes counted."""
    c0, cpu0 = bench.counters(), bench.cpu()
    records, wall = asyncio.run(ladder_load.run_load(f"{bench.url}/v1", MODEL, times, requests, a.answer))
    c1, cpu1 = bench.counters(), bench.cpu()
    d = {k: cpu1[k] - cpu0[k] for k in ("router", "control", "client")}
    engines = [x1 - x0 for x0, x1 in zip(cpu0["engines"], cpu1["engines"])]
    share = {k: round(v / wall, 3) for k, v in d.items()}
    share.update(engines=round(sum(engines) / wall, 3), engine_max=round(max(engines) / wall, 3),
                 machine=round((cpu1["busy"] - cpu0["busy"]) / (cpu1["total"] - cpu0["total"]) * CORES, 3))
    return {"scorer": bench.scorer, "rate": rate, "duration_s": a.duration, "wall_s": round(wall, 3),
            "counters": {k: c1[k] - c0[k] for k in c1},
            "cpu": {"router_s": round(d["router"], 3)}, "cpu_share": share,
            "errors_seen": sorted({r.error or f"{r.tokens} tokens" for r in records
                                   if r.error or r.tokens != a.answer})[:5],
            "records": [{"sent": round(r.sent, 4), "ttft": None if r.ttft is None else round(r.ttft, 4),
                         "tokens": r.tokens, "ok": r.error is None and r.tokens == a.answer and r.ttft is not None,
                         "group": r.group, "turn": r.turn} for r in records]}


def settings(a: argparse.Namespace) -> dict[str, Any]:
    shape = Shape(a.groups, a.users, a.turns, a.system, a.question, a.answer)
    prompts = [shape.prompt_tokens(k) for k in range(a.turns)]
    mean = sum(prompts) / len(prompts)
    p = float(KNOBS["LLMGW_SIM_PREFILL_TOKEN_LATENCY"])
    return {"replicas": a.replicas, "rates": a.rates, "duration_s": a.duration, "repeats": a.repeat,
            "warmup": {"seconds": a.warmup, "rate": WARMUP_RATE}, "route_keys": not a.no_route_keys,
            "knobs": dict(KNOBS), "kv_blocks": a.kv_blocks, "kv_tokens": (a.kv_blocks - 1) * BLOCK,
            "workload": {"groups": a.groups, "users": a.users, "turns": a.turns, "system": a.system,
                         "question": a.question, "answer": a.answer, "prompt_tokens": prompts,
                         "mean_prompt_tokens": round(mean)},
            # what the prefill lanes allow when no prompt token hits, and when every system prompt does
            "modelled_capacity_rps": {"no_hits": round(a.replicas / (p * mean), 1),
                                      "system_prompts_hit": round(a.replicas / (p * (mean - a.system)), 1)},
            "scale": QUICK_SCALE if a.quick else SCALE}


def write(out: Path, doc: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out.with_suffix(".json"), (json.dumps(doc, indent=1) + "\n").encode(), mode=0o644)
    write_atomic(out.with_suffix(".md"), report.markdown(doc).encode(), mode=0o644)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 engines, a small workload, one rate, one repeat")
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=None)
    ap.add_argument("--duration", type=float, default=None, help="seconds of arrivals per rate")
    ap.add_argument("--repeat", type=int, default=None)
    ap.add_argument("--warmup", type=float, default=None, help=f"seconds of arrivals at {WARMUP_RATE:g}/s before "
                    "the ladder, not measured")
    ap.add_argument("--scorers", type=lambda s: s.split(","), default=list(SCORERS),
                    help=f"a subset of {','.join(SCORERS)} (the targets need all three)")
    ap.add_argument("--no-route-keys", action="store_true",
                    help="engines without KV events: the cache-aware router's index stays empty (a control)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "routing-ladder"))
    ap.add_argument("--keep-logs", default=None, help="a directory for the processes' logs (default: removed)")
    ap.add_argument("--report-from", metavar="JSON", default=None,
                    help="rewrite the report (targets and .md) from a results file this command wrote; runs nothing")
    a = ap.parse_args(argv)
    if a.report_from:
        doc = json.loads(Path(a.report_from).read_text())
        doc["targets"], doc["notes"] = report.targets(doc["summary"]), NOTES
        write(Path(a.report_from).with_suffix(""), doc)
        return 0
    for k, v in (QUICK if a.quick else FULL).items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the processes on the way out
    _quiet_harness()
    shape = Shape(a.groups, a.users, a.turns, a.system, a.question, a.answer)
    t0 = time.monotonic()
    load_before = round(os.getloadavg()[0], 2)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="llmgw-ladder-") as tmp:
        workdir = Path(a.keep_logs or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for rep in range(a.repeat):
            # the same requests and arrival times for every scorer of a repeat
            stream = Conversations(shape, seed=rep + 1)
            warm = arrivals(WARMUP_RATE, a.warmup, seed=1000 * rep + 999) if a.warmup else []
            warm = (warm, stream.take(len(warm)))
            ladder = []
            for i, rate in enumerate(a.rates):
                times = arrivals(rate, a.duration, seed=1000 * rep + i)
                ladder.append((rate, times, stream.take(len(times))))
            order = [s for s in SCORERS if s in a.scorers]
            order = order if rep % 2 == 0 else order[::-1]
            for scorer in order:
                print(f"[{time.monotonic() - t0:6.1f}s] {scorer}, repeat {rep + 1}/{a.repeat}: a fleet of "
                      f"{a.replicas} engines and its router", flush=True)
                bench = Bench(workdir / f"{rep}-{scorer}", a, scorer)  # a fresh fleet: every cache starts empty
                try:
                    if warm[0]:  # not measured: every group's system prompt seen before the ladder starts
                        asyncio.run(ladder_load.run_load(f"{bench.url}/v1", MODEL, *warm, a.answer))
                    for rate, times, requests in ladder:
                        run = measure(bench, rate, requests, times, a)
                        run["repeat"] = rep
                        runs.append(run)
                        f = report.run_figures(run)
                        print(f"[{time.monotonic() - t0:6.1f}s]   {rate:g}/s: "
                              f"{sum(r['ok'] for r in run['records'])}/{len(run['records'])} ok, TTFT p50 "
                              f"{f['ttft_p50_s']} s p90 {f['ttft_p90_s']} s, {f['output_tokens_per_s']} tok/s, hit "
                              f"{f['hit_rate']}, router {f['router_cpu_us_per_request']} us/req, "
                              f"wall {run['wall_s']} s, machine CPU {run['cpu_share']['machine']}", flush=True)
                finally:
                    bench.close()
    summary = report.summarize(runs)
    command = " ".join(["PYTHONPATH=agent .venv/bin/python benchmarks/routing/ladder.py", *_flags(argv)])
    doc = {"command": command, "when": time.strftime("%Y-%m-%d"),
           "machine": f"{_cpu_model()}, {CORES} cores, Python {platform.python_version()}, load average "
                      f"{load_before} before, {round(os.getloadavg()[0], 2)} after",
           "cores": CORES, "elapsed_s": round(time.monotonic() - t0, 1), "settings": settings(a),
           "summary": summary,
           "saturation_rps": {s: report.saturation_rate(summary, s) for s in SCORERS},
           "targets": report.targets(summary), "notes": NOTES,
           "runs": [{k: v for k, v in r.items() if k != "records"} | report.run_figures(r) for r in runs]}
    write(Path(a.out), doc)
    print(f"[{time.monotonic() - t0:6.1f}s] wrote {a.out}.json and {a.out}.md", flush=True)
    return 0


def _flags(argv: list[str] | None) -> list[str]:
    """The command's flags as given, less where its files went."""
    args, out = list(sys.argv[1:] if argv is None else argv), []
    while args:
        arg = args.pop(0)
        if arg in ("--out", "--keep-logs"):
            args.pop(0) if args else None
        elif not arg.startswith(("--out=", "--keep-logs=")):
            out.append(arg)
    return out


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


if __name__ == "__main__":
    sys.exit(main())
