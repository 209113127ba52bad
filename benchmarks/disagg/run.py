"""Disaggregation benchmark: long prompts on aggregated vs prefill/decode engines, on the simulator.

    PYTHONPATH=agent .venv/bin/python benchmarks/disagg/run.py            # the full form (~6 min here)
    PYTHONPATH=agent .venv/bin/python benchmarks/disagg/run.py --quick    # one short rate, one repeat

At equal engine count, the same Poisson schedule of long-prompt streamed completions goes to
(a) N simulators that prefill and decode, and (b) P prefill (``kv_producer``) + N-P decode
(``kv_consumer``) simulators, each layout behind one ``llmgw router`` started as
benchmarks/router starts it (static endpoints with their ``role``; the router runs two phases
for the disaggregated layout). What differs is what the simulator models since
sim_interference: a prefill on an engine stalls the decode steps of every stream on that
engine, so aggregated streams slow down while long prompts arrive, and the decoders of the
disaggregated layout do not, at the price of a KV transfer per request
(``LLMGW_SIM_KV_TRANSFER_TOKEN_LATENCY``, stated in the report) and of prompts queueing on
fewer prefill engines.

Reported per layout and rate: TTFT and ITL p50/p90/p99 and output tokens/s as the client saw
them, the router's CPU per request (its process tree, from /proc), and the engines' and the
router's counters (prefill chunks, stalled decode steps, transfers, two-phase outcomes). Each
rate is repeated (layouts alternating, a fresh set of processes each time) and the spread
reported. Writes ``<out>.json`` (every figure and setting) and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "agent"), str(HERE)]

from llmgw.durable import write_atomic  # noqa: E402
from tests.support import procfs  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from tests.support.scrape import scrape  # noqa: E402

import poisson_load  # noqa: E402
import disagg_report as report  # noqa: E402


def _router_bench():
    """benchmarks/router/run.py, for its process helpers (spawn, wait_http, start_llmgw)."""
    spec = importlib.util.spec_from_file_location("router_bench", ROOT / "benchmarks" / "router" / "run.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["router_bench"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


rb = _router_bench()
HOST, PY = rb.HOST, rb.PY
MODEL = "long"

# The engine model: a large model on a GPU group (chosen, not fitted): 10k-token prefill in 0.5 s,
# 10 ms a token alone, decoding nearly flat in the batch (memory-bound), vLLM's default
# chunk of 8192 tokens, a KV cache of 480k tokens.
KNOBS = {"LLMGW_SIM_PREFILL_TOKEN_LATENCY": "5e-05", "LLMGW_SIM_TOKEN_LATENCY": "0.01",
         "LLMGW_SIM_DECODE_BATCH_SLOWDOWN": "0.005", "LLMGW_SIM_PREFILL_INTERFERENCE": "1"}
# KV of a 70B-class model with grouped-query attention (80 layers x 8 KV heads x 128 x 2 x 2 bytes
# = 320 KiB a token) over one 400 Gb/s adapter at 50 GB/s: 6.5 us a token.
TRANSFER_US = 6.5
TRANSFER_WHY = "320 KiB of KV a token (a 70B-class model with grouped-query attention) at 50 GB/s, one 400 Gb/s adapter"
ENGINE_ARGS = ["--max-model-len", "16384", "--num-gpu-blocks-override", "30000", "--max-num-batched-tokens", "8192",
               "--max-num-seqs", "1024"]
COUNTERS = ("llmgw_sim:prefill_chunks_total", "llmgw_sim:decode_steps_stalled_total",
            "vllm:nixl_xfer_time_seconds_count", "vllm:nixl_num_failed_transfers_total")


def router_outcomes(url: str) -> dict[str, float]:
    """``llmgw_router_prefill_total`` by outcome."""
    out: dict[str, float] = {}
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("llmgw_router_prefill_total{"):
                outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
                out[f"router prefill {outcome}"] = out.get(f"router prefill {outcome}", 0) + float(line.rsplit(" ", 1)[1])
    return out


class Layout:
    """One layout's processes: its engines and the router in front of them."""

    def __init__(self, name: str, engines: int, prefill: int, workdir: Path) -> None:
        self.name, self.procs, self.engines = name, [], []
        env = {**KNOBS, "LLMGW_SIM_KV_TRANSFER_TOKEN_LATENCY": f"{TRANSFER_US * 1e-6:g}"}
        roles = ["both"] * engines if name == "aggregated" else ["prefill"] * prefill + ["decode"] * (engines - prefill)
        pending = []
        for i, role in enumerate(roles):
            port = free_port()
            argv = [PY, "-m", "llmgw.sim.engine", "serve", MODEL, "--host", HOST, "--port", str(port), *ENGINE_ARGS]
            e = dict(env)
            if role != "both":
                kv = {"kv_connector": "NixlConnector", "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
                      "kv_buffer_device": "cpu", "kv_load_failure_policy": "recompute"}
                argv += ["--kv-transfer-config", json.dumps(kv)]
                if role == "prefill":
                    e.update(VLLM_NIXL_SIDE_CHANNEL_HOST=HOST, VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()))
            p = rb.spawn(f"{name}-{role}{i}", argv, workdir, e)
            self.procs.append(p)
            pending.append((p, f"http://{HOST}:{port}", role))
        for p, url, role in pending:
            rb.wait_http(url + "/health", 60, p.proc, p.log)
            self.engines.append((url, role))
        eps = [{"id": f"{role}{i}", "model": MODEL, "url": url, "role": role}
               for i, (url, role) in enumerate(self.engines)]
        self.router = rb.start_llmgw(f"router-{name}", eps, 1, workdir, None)
        self.procs.append(self.router.proc)

    def counters(self) -> dict[str, float]:
        """The engines' counters summed per role ("both engines: ...", "decode engines: ..."), and the
        router's two-phase outcomes."""
        total: dict[str, float] = {}
        for url, role in self.engines:
            for k, v in scrape(url, COUNTERS).items():
                if k.startswith("vllm:nixl") and role != "decode":
                    continue  # counted on the decoder
                key = f"{role} engines: {k}"
                total[key] = total.get(key, 0.0) + v
        total.update(router_outcomes(self.router.url))
        return total

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


def measure(layout: Layout, rate: float, duration: float, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    pid = layout.router.proc.proc.pid
    before, cpu0 = layout.counters(), procfs.tree_cpu_seconds(pid)
    records, wall = asyncio.run(poisson_load.run_load(layout.router.url, MODEL, rate, duration, seed, args.input_tokens,
                                                args.output_tokens, tag=f"{layout.name[0]}{seed}"))
    cpu = procfs.tree_cpu_seconds(pid) - cpu0
    after = layout.counters()
    ok = [r for r in records if r.error is None and r.tokens == args.output_tokens]
    errors = sorted({r.error or f"{r.tokens} tokens" for r in records if r not in ok})
    return {"layout": layout.name, "rate": rate, "seed": seed, "requests": len(records), "ok": len(ok),
            "errors_seen": errors[:5], "wall_s": round(wall, 3),
            "ttft_s": [r.ttft for r in ok if r.ttft is not None], "itl_s": [g for r in ok for g in r.gaps],
            "tpot_s": [sum(r.gaps) / len(r.gaps) for r in ok if r.gaps],
            "output_tokens": sum(r.tokens for r in records), "router_cpu_s": round(cpu, 3),
            "counters": {k: round(after[k] - before.get(k, 0), 3) for k in after}}


def settings(args: argparse.Namespace) -> dict[str, Any]:
    chunk = 8192
    per_token = float(KNOBS["LLMGW_SIM_PREFILL_TOKEN_LATENCY"])
    return {"input_tokens": args.input_tokens, "output_tokens": args.output_tokens, "duration_s": args.duration,
            "rates": args.rates, "repeats": args.repeat, "engines": args.engines, "prefill": args.prefill,
            "knobs": dict(KNOBS), "engine_args": ENGINE_ARGS, "chunk_tokens": chunk,
            "chunks_per_prompt": -(-args.input_tokens // chunk),
            "prefill_ms": round(per_token * args.input_tokens * 1000, 1),
            "transfer": {"per_token_us": TRANSFER_US, "prompt_tokens": args.input_tokens,
                         "prompt_ms": round(TRANSFER_US * args.input_tokens / 1000, 1), "why": TRANSFER_WHY}}


NOTES = [
    "Aggregated engines prefill in the same steps as they decode: each 8192-token chunk of an arriving prompt "
    "delays the next token of every stream on that engine (the simulator's prefill/decode interference model, "
    "docs/testing.md). With 1,000-token outputs a stall is one gap in a few hundred, so it shows in ITL p99.9 "
    "and, summed over a request's life, in TPOT, more than in ITL p50-p99. The decoders of the disaggregated "
    "layout only pull KV and never stall.",
    "The disaggregated layout prefills every prompt on fewer engines: prompts queue there, so its TTFT grows "
    "with the rate faster than the aggregated layout's, and it pays the transfer and a second hop on each "
    "request.",
    "Absolute figures follow the stated knobs, not a measured GPU; the comparison between layouts is what the "
    "model gives. Client, router and engines share one small machine, so the client's timestamps carry its "
    "scheduling noise (the same for both layouts).",
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one rate, short run, one repeat, 100 output tokens")
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=None)
    ap.add_argument("--duration", type=float, default=None, help="seconds of arrivals per run")
    ap.add_argument("--repeat", type=int, default=None)
    ap.add_argument("--input-tokens", type=int, default=10_000)
    ap.add_argument("--output-tokens", type=int, default=None)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--prefill", type=int, default=2, help="prefill engines of the disaggregated layout")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "disagg"))
    ap.add_argument("--keep-logs", default=None, help="a directory for the processes' logs (default: removed)")
    ap.add_argument("--report-from", metavar="JSON", default=None,
                    help="rewrite the report (targets and .md) from a results file this command wrote; runs nothing")
    args = ap.parse_args(argv)
    if args.report_from:
        doc = json.loads(Path(args.report_from).read_text())
        doc["targets"] = report.targets(doc["summary"], doc["settings"]["transfer"])
        out = Path(args.report_from).with_suffix("")
        write_atomic(out.with_suffix(".json"), (json.dumps(doc, indent=1) + "\n").encode(), mode=0o644)
        write_atomic(out.with_suffix(".md"), report.markdown(doc).encode(), mode=0o644)
        return 0
    args.rates = args.rates or ([2.0] if args.quick else [1.0, 2.0, 3.0])
    args.duration = args.duration or (5.0 if args.quick else 12.0)
    args.repeat = args.repeat or (1 if args.quick else 2)
    args.output_tokens = args.output_tokens or (100 if args.quick else 1000)
    if not 0 < args.prefill < args.engines:
        ap.error("--prefill must leave at least one decode engine")

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the processes on the way out
    t0 = time.monotonic()
    load_before = [round(x, 2) for x in os.getloadavg()]
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="llmgw-disagg-") as tmp:
        workdir = Path(args.keep_logs or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for rep in range(args.repeat):
            order = report.LAYOUTS if rep % 2 == 0 else report.LAYOUTS[::-1]
            for name in order:
                print(f"[{time.monotonic() - t0:6.1f}s] {name}, repeat {rep + 1}/{args.repeat}: starting", flush=True)
                layout = Layout(name, args.engines, args.prefill, workdir)
                try:
                    for i, rate in enumerate(args.rates):
                        run = measure(layout, rate, args.duration, seed=1000 * rep + i, args=args)
                        run["repeat"] = rep
                        runs.append(run)
                        f = report.run_figures(run)
                        print(f"[{time.monotonic() - t0:6.1f}s]   {rate:g}/s: {run['ok']}/{run['requests']} ok, "
                              f"TTFT p50 {f['ttft_p50_ms']} ms, ITL p99 {f['itl_p99_ms']} ms, "
                              f"{f['output_tokens_per_s']} tok/s, router {f['router_cpu_us_per_request']} us/req",
                              flush=True)
                finally:
                    layout.stop()
    s = settings(args)
    summary = report.summarize(runs)
    command = "PYTHONPATH=agent .venv/bin/python benchmarks/disagg/run.py" + (" --quick" if args.quick else "")
    doc = {"command": command, "when": time.strftime("%Y-%m-%d"), "machine": f"{rb._cpu_model()}, "
           f"{os.cpu_count()} cores, Python {platform.python_version()}, load average {load_before[0]} before, "
           f"{round(os.getloadavg()[0], 2)} after",
           "elapsed_s": round(time.monotonic() - t0, 1), "settings": s, "summary": summary,
           "comparison": {"itl_p99_ms": report.compare(summary, "itl_p99_ms"),
                          "itl_p999_ms": report.compare(summary, "itl_p999_ms"),
                          "tpot_p50_ms": report.compare(summary, "tpot_p50_ms"),
                          "ttft_p50_ms": report.compare(summary, "ttft_p50_ms"),
                          "output_tokens_per_s": report.compare(summary, "output_tokens_per_s", lower_is_better=False)},
           "targets": report.targets(summary, s["transfer"]), "notes": NOTES,
           "runs": [{k: v for k, v in r.items() if k not in ("ttft_s", "itl_s", "tpot_s")} | report.run_figures(r) for r in runs]}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out.with_suffix(".json"), (json.dumps(doc, indent=1) + "\n").encode(), mode=0o644)
    write_atomic(out.with_suffix(".md"), report.markdown(doc).encode(), mode=0o644)
    print(f"[{time.monotonic() - t0:6.1f}s] wrote {out}.json and {out}.md", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
