"""Router benchmark: llmgw router beside direct, nginx and LiteLLM, on the engine simulator.

    python benchmarks/router/run.py [--quick] [--skip litellm,nginx] [--out benchmarks/results/router]
    python benchmarks/router/run.py --only nginx,aiohttp-bare,llmgw-1w --workloads stream-64 --repeat 3
    python benchmarks/router/run.py --engine-tls --only llmgw-1w,llmgw-1w-tls --workloads stream-64 --repeat 5

Everything runs on loopback as child processes of this script and is
stopped at the end: two simulators (``fast``: no token latency, ``slow``:
20 ms per token), each proxy, and the load generator in its own process
(benchmarks/router/loadgen.py).  Proxy CPU is read from /proc/<pid>/stat of
the proxy's whole process tree (master and workers).

Placement (``--layout``): by default the proxy under test runs on a CPU of
its own and the simulators and load generator on the others, the way
clients, router and engines are separate hosts in a fleet; then the
256-stream workload is measured again with every process free to run on
every CPU, so the report also shows what contention on one small host does.

``--limits`` adds ``llmgw-1w-key`` and ``llmgw-1w-limits``: the same router
with the load generator's key configured, without and with a ``limits``
block on every dimension, set too high to refuse anything (every request is
reserved, settled from usage and answered with rate-limit headers); the two
side by side give what per-key limits cost per request (``llmgw-1w`` has no
key at all, so it also skips the per-key caps of ``clients``).

``--engine-tls`` adds ``llmgw-1w-tls``: the same router to two more simulators
serving HTTPS with an engine certificate of a throwaway fleet CA, which the
router verifies (``engine_ca``), as a fleet with engine TLS runs; set beside
``llmgw-1w`` it gives what TLS to the engine costs per chunk.

Writes ``<out>.json`` (every number) and ``<out>.md`` (tables, ratios, the
targets and whether they were met).  LiteLLM lives in its own virtualenv
(benchmarks/.venv-litellm, created with ``pip install 'litellm[proxy]'`` if
missing); nginx is Debian's package (``apt-get install nginx-light``).  A
baseline asked for (not left out with ``--skip``/``--only``) that cannot
start is named with the reason, on stdout and in both files (``missing``,
the report's "Missing baselines"), and every comparison with it is marked
"not measured": a run without nginx says so instead of comparing with
nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PY = sys.executable
LITELLM_VENV = ROOT / "benchmarks" / ".venv-litellm"
HOST = "127.0.0.1"

sys.path.insert(0, str(ROOT))
from tests.support import procfs  # noqa: E402
from tests.support.childenv import child_env  # noqa: E402
from tests.support.ports import free_port  # noqa: E402


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None,
              context: ssl.SSLContext | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited {proc.returncode}\n{log.read_text()[-3000:] if log else ''}")
        try:
            with urllib.request.urlopen(url, timeout=2, context=context) as r:
                if r.status < 500:
                    return
        except urllib.error.HTTPError as e:
            if e.code < 500:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not up after {timeout}s\n{log.read_text()[-3000:] if log else ''}")


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def spawn(name: str, argv: list[str], workdir: Path, env: dict | None = None, cpus: str | None = None) -> Proc:
    log = workdir / f"{name}.log"
    if cpus:
        argv = ["taskset", "-c", cpus, *argv]
    with open(log, "wb") as f:
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env=child_env(env), start_new_session=True, cwd=workdir)
    return Proc(name, p, log)


# ------------------------------------------------------------------ CPU accounting

def cpu_times() -> dict[int, tuple[int, int]]:
    """Per CPU: (all ticks, steal ticks) from /proc/stat.

    Steal is time the hypervisor ran something else while this virtual CPU
    had work: on a shared VM it comes in bursts of milliseconds, and any
    process that was running waits them out, which shows in latency tails.
    """
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu") and line[3:4].isdigit():
            name, *vals = line.split()
            ticks = [int(v) for v in vals[:8]]
            out[int(name[3:])] = (sum(ticks), ticks[7])
    return out


def steal_share(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]]) -> dict[int, float]:
    """Per CPU, the share of the interval stolen by the hypervisor."""
    out = {}
    for cpu, (total, steal) in after.items():
        t0, s0 = before.get(cpu, (total, steal))
        out[cpu] = (steal - s0) / (total - t0) if total > t0 else 0.0
    return out


def move_tree(root: int, cpus: set[int]) -> None:
    """Put every thread of a running process tree on ``cpus`` (what ``taskset -a -p`` does, for a tree).

    Affinity is per thread; a worker forked later inherits its parent's.
    """
    for pid in procfs.tree_pids(root):
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError:  # exited meanwhile
                pass


# ----------------------------------------------------------------- the system

@dataclass
class Target:
    name: str
    url: str  # serves both models ("fast" and "slow")
    proc: Proc | None = None
    note: str = ""
    api_key: str = "bench"


@dataclass(frozen=True)
class EnginePki:
    """A throwaway fleet CA and an engine certificate for HOST, as the pki role issues them."""

    ca: Path
    cert: Path
    key: Path


def engine_pki(workdir: Path) -> EnginePki:
    from llmgw.tls import init_ca
    from llmgw.tls.files import write_pair
    from llmgw.tls.issue import issue_engine

    ca = init_ca(workdir / "engine-ca")
    cert, key = write_pair(workdir / "engine", *issue_engine(ca, [], [HOST]))
    return EnginePki(ca.cert_path, cert, key)


def start_sim(model: str, env: dict, workdir: Path, cpus: str | None,
              tls: EnginePki | None = None) -> tuple[Proc, str]:
    """A simulator of ``model``; with ``tls``, serving HTTPS with the engine certificate (vLLM's flags)."""
    port = free_port()
    argv = [PY, "-m", "llmgw.sim.engine", "serve", model, "--host", HOST, "--port", str(port),
            "--max-num-seqs", "4096"]
    if tls is not None:
        argv += ["--ssl-keyfile", str(tls.key), "--ssl-certfile", str(tls.cert)]
    p = spawn(f"sim-{model}-{port}{'-tls' if tls else ''}", argv, workdir, env, cpus)
    url = f"{'https' if tls else 'http'}://{HOST}:{port}"
    context = ssl.create_default_context(cafile=str(tls.ca)) if tls is not None else None
    wait_http(url + "/health", 60, p.proc, p.log, context)
    return p, url


NGINX_CONF = """
worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/nginx-error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    upstream fast {{ server {fast}; keepalive 512; }}
    upstream slow {{ server {slow}; keepalive 512; }}
    server {{
        listen {host}:{port};
        keepalive_requests 1000000;
        location / {{
            # nginx cannot route on the JSON body's "model": the path decides instead,
            # /slow/... goes to the slow engine, everything else to the fast one.
            proxy_pass http://fast;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_cache off;
            proxy_read_timeout 600s;
        }}
        location /slow/ {{
            proxy_pass http://slow/;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_cache off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


NGINX_MISSING = "not installed (apt-get install nginx-light)"


def start_nginx(fast: str, slow: str, workdir: Path, cpus: str | None) -> Target:
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(nginx).exists():
        raise RuntimeError(NGINX_MISSING)
    d = workdir / "nginx"
    d.mkdir(exist_ok=True)
    port = free_port()
    conf = d / "nginx.conf"
    conf.write_text(NGINX_CONF.format(dir=d, host=HOST, port=port, fast=fast.split("//")[1],
                                      slow=slow.split("//")[1]))
    p = spawn("nginx", [nginx, "-p", str(d), "-c", str(conf)], workdir, cpus=cpus)
    url = f"http://{HOST}:{port}"
    wait_http(url + "/v1/models", 30, p.proc, p.log)
    return Target("nginx", url, p, "nginx 1 worker, proxy_buffering off, upstream keepalive 512, access_log off")


def ensure_litellm() -> Path:
    exe = LITELLM_VENV / "bin" / "litellm"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(LITELLM_VENV)], check=True)
        subprocess.run([str(LITELLM_VENV / "bin" / "pip"), "install", "-q", "litellm[proxy]"], check=True)
    return exe


def start_litellm(fast: str, slow: str, workdir: Path, cpus: str | None) -> Target:
    exe = ensure_litellm()
    port = free_port()
    key = "sk-" + os.urandom(16).hex()  # LiteLLM refuses to start without a master key
    cfg = workdir / "litellm.yaml"
    cfg.write_text(json.dumps({
        "model_list": [
            {"model_name": m, "litellm_params": {"model": f"hosted_vllm/{m}", "api_base": f"{u}/v1",
                                                 "api_key": "none"}}
            for m, u in (("fast", fast), ("slow", slow))
        ],
        "litellm_settings": {"telemetry": False, "drop_params": True, "request_timeout": 600,
                             "num_retries": 0},
        "general_settings": {"disable_spend_logs": True, "disable_error_logs": True, "master_key": key},
    }))
    env = {
        # loopback only: no model-cost-map download, no telemetry
        "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False", "DISABLE_ADMIN_UI": "True",
        "LITELLM_LOG": "ERROR", "NO_PROXY": "*",
    }
    p = spawn("litellm", [str(exe), "--config", str(cfg), "--host", HOST, "--port", str(port),
                          "--num_workers", "1"], workdir, env, cpus)
    url = f"http://{HOST}:{port}"
    wait_http(url + "/health/liveliness", 180, p.proc, p.log)
    return Target("litellm", url, p, "LiteLLM proxy 1 worker, hosted_vllm provider, master key auth",
                  api_key=key)


def start_bare(fast: str, slow: str, workdir: Path, cpus: str | None) -> Target:
    port = free_port()
    p = spawn("aiohttp-bare", [PY, str(HERE / "bare_relay.py"), fast, str(port), f"/slow={slow}"], workdir, cpus=cpus)
    url = f"http://{HOST}:{port}"
    wait_http(url + "/v1/models", 60, p.proc, p.log)
    return Target("aiohttp-bare", url, p, "reference: the thinnest aiohttp relay (benchmarks/router/bare_relay.py), "
                                          "no router logic")


def start_llmgw(name: str, endpoints: list[dict], workers: int, workdir: Path, cpus: str | None,
                extra: dict | None = None, env: dict | None = None) -> Target:
    port = free_port()
    cfg = workdir / f"{name}.yaml"
    doc = {"listen": {"host": HOST, "port": port}, "allow_unauthenticated": True, "insecure_http": True,
           "access_log": False,
           "static_endpoints": endpoints, **(extra or {})}
    cfg.write_text(json.dumps(doc))
    p = spawn(name, [PY, "-m", "llmgw.router", "--config", str(cfg), "--workers", str(workers)], workdir, env, cpus)
    url = f"http://{HOST}:{port}"
    wait_http(url + "/healthz", 120, p.proc, p.log)
    return Target(name, url, p, f"llmgw router, {workers} worker(s), access_log off")


def start_llmgw_key(name: str, eps: list[dict], workdir: Path, cpus: str | None, limited: bool,
                    env: dict | None = None) -> Target:
    """llmgw-1w with the load generator's key configured; ``limited``: on every dimension, none reached.

    ``env``: the router's environment on top of this one's (``PYTHONPATH``: another tree's router)."""
    import hashlib
    big = 10 ** 12
    key: dict[str, Any] = {"name": "bench", "sha256": hashlib.sha256(b"bench").hexdigest()}
    if limited:
        key["limits"] = {"requests_per_minute": big, "input_tokens_per_minute": big,
                         "output_tokens_per_minute": big, "tokens_per_minute": big, "concurrent_requests": big,
                         "tokens_per_day": big}
    t = start_llmgw(name, eps, 1, workdir, cpus, {"api_keys": [key]}, env)
    t.note = ("llmgw router, 1 worker, access_log off, the client's key " +
              ("under limits on every dimension (none reached)" if limited else "configured, no limits"))
    return t


def start_llmgw_tls(workdir: Path, cpus_up: str | None, cpus_proxy: str | None, procs: list[Proc]) -> Target:
    """llmgw-1w to its own two simulators serving HTTPS, verified against the engine CA."""
    pki = engine_pki(workdir)
    fast_p, fast = start_sim("fast", {}, workdir, cpus_up, pki)
    slow_p, slow = start_sim("slow", {"LLMGW_SIM_TOKEN_LATENCY": "0.02"}, workdir, cpus_up, pki)
    procs += [fast_p, slow_p]
    eps = [{"id": "fast0", "model": "fast", "url": fast}, {"id": "slow0", "model": "slow", "url": slow}]
    t = start_llmgw("llmgw-1w-tls", eps, 1, workdir, cpus_proxy, {"engine_ca": str(pki.ca)})
    t.note = "llmgw router, 1 worker, access_log off, HTTPS to the simulators (engine certificate verified)"
    return t


# ---------------------------------------------------------------- workloads

@dataclass
class Workload:
    name: str
    model: str
    stream: bool
    max_tokens: int
    concurrency: int
    duration: float
    what: str
    extra: list[str] = field(default_factory=list)
    warmup: float = 0.0  # unmeasured seconds of the same load before the window (connections, pools)
    stagger: float = 0.0  # first requests spread over this many seconds (loadgen --stagger)


def workloads(quick: bool) -> list[Workload]:
    d = 3.0 if quick else 8.0
    return [
        Workload("small-c16", "fast", False, 1, 16, d, "non-streaming, 1 token, 16 concurrent", warmup=1.0),
        Workload("small-c64", "fast", False, 1, 64, d, "non-streaming, 1 token, 64 concurrent", warmup=1.0),
        Workload("stream-64", "fast", True, 64, 16, d, "streaming, 64 chunks, no token delay, 16 concurrent",
                 warmup=1.0),
        # each stream lasts ~1 s: 3 s of warm-up are three generations of streams, every connection open;
        # the streams start spread over one stream's length, so arrivals are even, not a lockstep burst
        Workload("stream-256x20ms", "slow", True, 50, 256, d + 2,
                 "streaming, 256 concurrent streams, 20 ms/token, 50 tokens", warmup=3.0, stagger=1.0),
    ]


def target_url(t: Target, w: Workload) -> str:
    if t.name in ("direct", "nginx", "aiohttp-bare") and w.model == "slow":
        return t.url_slow if t.name == "direct" else t.url + "/slow"
    return t.url


def run_load(url: str, w: Workload, cpus: str | None, model: str | None = None, api_key: str = "bench",
             on_warm: Callable[[], None] | None = None) -> dict:
    """Run the load generator; ``on_warm`` is called when its measured window opens."""
    argv = [PY, str(HERE / "loadgen.py"), "--url", url, "--model", model or w.model, "--api-key", api_key,
            "--max-tokens", str(w.max_tokens), "--warmup", str(w.warmup),
            "--concurrency", str(w.concurrency), "--duration", str(w.duration), "--stagger", str(w.stagger),
            *w.extra]
    if w.stream:
        argv.append("--stream")
    if cpus:
        argv = ["taskset", "-c", cpus, *argv]
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True)
        killer = threading.Timer(w.warmup + w.duration + 180, proc.kill)  # a hung run ends as a failure
        killer.start()
        try:
            lines = []
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.strip() == "warm" and on_warm is not None:
                    on_warm()
                lines.append(line)
            rc = proc.wait()
        finally:
            killer.cancel()
        if rc != 0 or not lines:
            err.seek(0)
            raise RuntimeError(f"loadgen failed: {err.read()[-2000:].decode(errors='replace')}")
    return json.loads(lines[-1])


def warm(t: Target, cpus: str | None) -> None:
    """A short unmeasured load first: imports, pools and caches of every target start warm."""
    for w in (Workload("warm", "fast", False, 1, 4, 1.5, ""), Workload("warm", "fast", True, 8, 4, 1.5, "")):
        try:
            run_load(target_url(t, w), w, cpus, api_key=t.api_key)
        except Exception:  # noqa: BLE001 - a failure shows in the measured runs
            pass


def measure(t: Target, w: Workload, cpus: str | None) -> dict:
    url = target_url(t, w)
    pid = t.proc.proc.pid if t.proc else None
    c0 = [0.0]

    stat0: list[dict[int, tuple[int, int]]] = [cpu_times()]

    def window_opens() -> None:
        stat0[0] = cpu_times()
        if pid:
            c0[0] = procfs.tree_cpu_seconds(pid)

    res = run_load(url, w, cpus, api_key=t.api_key, on_warm=window_opens)
    c1 = procfs.tree_cpu_seconds(pid) if pid else 0.0
    res["steal"] = steal_share(stat0[0], cpu_times())
    cpu = c1 - c0[0]
    res["proxy_cpu_s"] = cpu if pid else None
    res["proxy_cpu_per_request_us"] = cpu / res["ok"] * 1e6 if pid and res["ok"] else None
    res["proxy_cpu_per_chunk_us"] = cpu / res["chunks"] * 1e6 if pid and res["chunks"] else None
    res["proxy_cpu_util"] = cpu / res["elapsed_s"] if pid else None
    return res


def measure_round(w: Workload, running: list[Target], cpus: str | None, repeat: int, t0: float,
                  label: str = "") -> dict[str, dict]:
    """Measure ``w`` on every target, ``repeat`` times round the targets; the median run of each."""
    samples: dict[str, list[dict]] = {t.name: [] for t in running}
    for rep in range(max(1, repeat)):
        for t in running:
            print(f"[{time.monotonic() - t0:6.1f}s]   {w.name} / {t.name} {label}({rep + 1}/{max(1, repeat)})",
                  flush=True)
            try:
                samples[t.name].append(measure(t, w, cpus))
            except Exception as e:  # noqa: BLE001 - a failed measurement is reported in its row
                samples[t.name].append({"error": str(e)})
    return {name: median_run(runs, w) for name, runs in samples.items()}


def median_run(runs: list[dict], w: Workload) -> dict:
    """The median run by CPU (per chunk for streams, per request otherwise), with every run's figure.

    On a small shared machine one run's CPU per chunk moves by several percent; a change to
    the relay is only believable when it moves the number by more than the runs disagree.
    """
    good = [r for r in runs if "error" not in r]
    if not good:
        return runs[0]
    key = "proxy_cpu_per_chunk_us" if w.stream else "proxy_cpu_per_request_us"
    if len(good) == 1 or good[0].get(key) is None:
        return good[0]
    good.sort(key=lambda r: r[key])
    med = dict(good[len(good) // 2])
    med["repeats"] = [r[key] for r in good]
    return med


# ----------------------------------------------------------------- prefix affinity

def prefix_affinity(workdir: Path, quick: bool, cpus_up: str | None, cpus_proxy: str | None) -> dict:
    out: dict[str, Any] = {}
    env = {"LLMGW_SIM_PREFIX_CACHE_BLOCKS": "96", "LLMGW_SIM_TOKEN_LATENCY": "0.002"}
    w = Workload("prefix", "pa", True, 4, 16, 4.0 if quick else 10.0, "16 shared system prompts, 4 replicas",
                 ["--prefix-prompts", "16", "--prefix-words", "200"])
    for scorer in ("least-outstanding", "prefix-affinity"):
        sims = [start_sim("pa", env, workdir, cpus_up) for _ in range(4)]
        try:
            eps = [{"id": f"replica{i}", "model": "pa", "url": u} for i, (_, u) in enumerate(sims)]
            t = start_llmgw(f"llmgw-{scorer}", eps, 1, workdir, cpus_proxy,
                            {"balancing": {"scorer": scorer, "prefix_tokens": 256}})
            try:
                before = [sim_prefix(u) for _, u in sims]
                res = run_load(t.url, w, cpus_up)
                after = [sim_prefix(u) for _, u in sims]
            finally:
                t.proc.stop()
        finally:
            for p, _ in sims:
                p.stop()
        replicas = []
        for i, (b, a) in enumerate(zip(before, after)):
            q, h = a[0] - b[0], a[1] - b[1]
            replicas.append({"replica": f"replica{i}", "prompt_tokens": q, "hit_tokens": h,
                             "hit_share": h / q if q else None})
        tq = sum(r["prompt_tokens"] for r in replicas)
        th = sum(r["hit_tokens"] for r in replicas)
        out[scorer] = {"load": res, "replicas": replicas, "hit_share": th / tq if tq else None}
    return out


def sim_prefix(url: str) -> tuple[float, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    q = h = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:prefix_cache_queries_total"):
            q += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:prefix_cache_hits_total"):
            h += float(line.rsplit(" ", 1)[1])
    return q, h


# ------------------------------------------------------------------- report

def fmt(v: Any, nd: int = 1) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:,.{nd}f}"
    return str(v)


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "–"
    return f"{a / b:.2f}x"


def report(results: dict) -> str:
    L: list[str] = []
    meta = results["meta"]
    L.append("# Router benchmark")
    L.append("")
    flags = meta.get("flags", " --quick" if meta["quick"] else "")
    L.append(f"Generated by `python benchmarks/router/run.py{flags}` on "
             f"{meta['date']}; {meta['cpus']} CPUs ({meta['cpu_model']}), Python {meta['python']}, "
             f"kernel {meta['kernel']}. Upstream: the engine simulator (`llmgw.sim.engine`), one process per model. "
             f"Load generator: its own process (aiohttp, closed loop). CPU placement: {meta['placement']}.")
    L.append("")
    L.append("Targets: " + "; ".join(f"**{t['name']}**: {t['note']}" for t in results["targets"]))
    L.append("")
    gone = missing_lines(results)
    if gone:
        L.append("**Missing baselines** (requested but not run; every comparison with them is marked not measured):")
        L.append("")
        L.extend(f"- {line}" for line in gone)
        L.append("")
    L.append("Each measurement starts with a warm-up of the same load (1 s; 3 s for stream-256x20ms) that is not "
             "counted, so every client connection and every connection a proxy keeps to its upstream is open "
             "before the window: without it the first wave of 256 streams measures TCP handshakes and "
             "listen-backlog overflow (a dropped SYN costs 1 s), which dominated TTFT p99 for every proxy. "
             "In stream-256x20ms the 256 streams start spread over one stream's length (loadgen --stagger), so "
             "requests arrive evenly as from independent clients; started together they stay in lockstep and "
             "TTFT p99 measures how long the last of a 256-request burst waits behind the others. "
             "Stolen % is the share of each CPU's time the hypervisor gave to other guests during the window "
             "(steal in /proc/stat): it arrives in bursts of milliseconds, and whatever was running waits them "
             "out, so a run with more steal has longer latency tails whichever target it measured. "
             "CPU is the proxy's whole process tree (utime+stime from /proc/<pid>/stat, children included) over the "
             "measured window; per request = CPU / requests completed in it, per chunk = CPU / SSE events relayed "
             "in it; TTFT and latency cover the requests sent in it. Every target stays up for the whole run and "
             "each workload's repeats go round the targets in turn, so figures compared with each other are "
             "measured close together.")
    L.append("")
    L.append("Reading the numbers: " + PLACEMENT_TEXT.get(meta.get("layouts", ["shared"])[0], "")
             + " The CPU columns do not depend on placement; they are the comparison that survives "
             "contention. The aiohttp-bare row is the thinnest relay on aiohttp's ordinary read/write "
             "path; the llmgw rows add the router's own work (keys, routing, retries, SSE event boundaries, "
             "watchdogs, metrics) but talk to engines with their own HTTP/1.1 client and relay committed streams "
             "from the upstream connection's read callback, below that path, so per chunk they can come in under it. "
             "In stream-64 the simulator writes without delay, so several events arrive per "
             "read and the per-chunk cost is lower for every proxy than with real token spacing (stream-256x20ms).")
    L.append("")
    names = [t["name"] for t in results["targets"]]
    for w in results["workloads"]:
        L.append(f"## {w['name']}: {w['what']}")
        L.append("")
        _table(L, results["runs"].get(w["name"], {}), names, results.get("missing", {}))
    shared = results.get("runs_shared")
    if shared:
        for wn, rows in shared.items():
            what = next((w["what"] for w in results["workloads"] if w["name"] == wn), "")
            L.append(f"## {wn} on shared CPUs: {what}")
            L.append("")
            L.append("The same targets, moved while running onto every CPU, with the simulator and the load "
                     "generator also free to run anywhere: the proxy now competes for CPU with the engine and "
                     "the clients, as it would if all three shared one small host. Measured after the tables "
                     "above, in the same run.")
            L.append("")
            _table(L, rows, names, results.get("missing", {}))
    L.append("## Targets")
    L.append("")
    L.append("| target | measured | met |")
    L.append("|---|---|---|")
    for t in results["checks"]:
        met = "yes" if t["met"] else ("NO" if t["met"] is False else t.get("why") or "inconclusive")
        L.append(f"| {t['what']} | {t['measured']} | {met} |")
    L.append("")
    pa = results.get("prefix_affinity")
    if pa:
        L.append("## Prefix affinity: 16 shared system prompts (~200 tokens each) over 4 replicas")
        L.append("")
        L.append("Each simulator replica has a 96-block (1,536-token) prefix cache, smaller than the 16 prompts "
                 "together (~3,200 tokens) but larger than a quarter of them. Hit share = "
                 "`vllm:prefix_cache_hits` / `vllm:prefix_cache_queries` (tokens), per replica, over the run.")
        L.append("")
        L.append("| scorer | req/s | " + " | ".join(f"replica{i} hit share (prompt tokens)" for i in range(4))
                 + " | overall hit share |")
        L.append("|---|---|" + "---|" * 5)
        for scorer, v in pa.items():
            cells = [f"{fmt(r['hit_share'] and r['hit_share'] * 100, 1)}% ({int(r['prompt_tokens']):,})"
                     for r in v["replicas"]]
            L.append(f"| {scorer} | {fmt(v['load']['rps'])} | " + " | ".join(cells)
                     + f" | {fmt(v['hit_share'] and v['hit_share'] * 100, 1)}% |")
        L.append("")
    L.append("## Notes")
    L.append("")
    for note in results["notes"]:
        L.append(f"- {note}")
    L.append("")
    return "\n".join(L)


def missing_lines(results: dict) -> list[str]:
    """``nginx: not installed (...)`` for each requested baseline that did not run, so a report whose
    comparisons with it are absent says why instead of silently comparing with nothing."""
    return [f"{name}: {why}" for name, why in sorted(results.get("missing", {}).items())]


NOT_MEASURED = "not measured"


def _table(L: list[str], rows: dict, names: list[str], missing: dict[str, str] | None = None) -> None:
    """One workload's rows; a column against a baseline that did not run says so rather than ``–``."""
    L.append("| target | req/s | tokens/s | TTFT p50 ms | TTFT p99 ms | latency p99 ms | errors | stolen % by CPU "
             "| CPU/req µs | CPU/chunk µs | CPU util | req/s vs direct | req/s vs nginx | CPU/req vs nginx "
             "| CPU/chunk vs nginx |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    d, n = rows.get("direct"), rows.get("nginx")
    missing = missing or {}

    def vs(a: float | None, b: float | None, baseline: str) -> str:
        return NOT_MEASURED if baseline in missing else ratio(a, b)
    for name in names:
        r = rows.get(name)
        if r is None:
            continue
        if "error" in r:
            L.append(f"| {name} | failed: {r['error'][:80]} |" + " |" * 14)
            continue
        errs = sum(r["errors"].values())
        L.append("| " + " | ".join([
            name, fmt(r["rps"]), fmt(r["tokens_per_s"], 0), fmt(r["ttft_p50_ms"], 2), fmt(r["ttft_p99_ms"], 2),
            fmt(r["latency_p99_ms"], 2), str(errs),
            " / ".join(f"{v * 100:.0f}" for _, v in sorted(r.get("steal", {}).items(), key=lambda kv: int(kv[0])))
            or "–",
            fmt(r["proxy_cpu_per_request_us"], 0)
            + (_spread(r, "proxy_cpu_per_request_us") if r.get("proxy_cpu_per_chunk_us") is None else ""),
            fmt(r["proxy_cpu_per_chunk_us"], 1) + _spread(r, "proxy_cpu_per_chunk_us"),
            fmt(r["proxy_cpu_util"], 2),
            vs(r["rps"], d and d["rps"], "direct"), vs(r["rps"], n and n.get("rps"), "nginx"),
            vs(r["proxy_cpu_per_request_us"], n and n.get("proxy_cpu_per_request_us"), "nginx"),
            vs(r["proxy_cpu_per_chunk_us"], n and n.get("proxy_cpu_per_chunk_us"), "nginx"),
        ]) + " |")
    L.append("")


def _spread(r: dict, key: str) -> str:
    """`` (a–b, n runs)`` after a repeated figure: the report shows the median and the range."""
    reps = r.get("repeats")
    if not reps or r.get(key) is None or len(reps) < 2:
        return ""
    return f" ({min(reps):,.1f}–{max(reps):,.1f}, {len(reps)} runs)"


# workloads whose judged figures (token throughput, TTFT) depend on where processes run
LAYOUT_WORKLOADS = ("stream-256x20ms",)
LAYOUT_LABEL = {"isolated": "proxy on its own CPU", "shared": "shared CPUs"}
PLACEMENT_TEXT = {
    "isolated": "the proxy under test has its own CPU and the simulators and the load generator share the "
                "others, as in a deployment where clients, router and engines are different hosts; what a proxy "
                "adds to latency and takes from throughput is then its own work, not time spent waiting for a "
                "CPU the engine or the clients hold. Direct runs the same simulator and load generator on the "
                "same CPUs, so every ratio compares like with like. The last section repeats the 256-stream "
                "workload with all CPUs shared.",
    "shared": "every process competes for the same cores, so throughput and latency columns include the time a "
              "proxy waits for a CPU held by the simulator or the load generator and move with the scheduler "
              "from run to run.",
}


def checks(results: dict) -> list[dict]:
    layouts = results["meta"].get("layouts") or ["shared"]
    out = []
    for i, layout in enumerate(layouts):
        runs = results["runs"] if i == 0 else results.get("runs_shared", {})
        out += _checks(results, runs, LAYOUT_LABEL[layout], primary=i == 0)
    return out


def _stolen(runs: dict, target: str) -> str:
    """The largest per-CPU steal share in ``target``'s stream-256x20ms run, as a percentage."""
    steal = (runs.get("stream-256x20ms", {}).get(target) or {}).get("steal") or {}
    return f"{max(steal.values()) * 100:.0f}%" if steal else "–"


def _checks(results: dict, runs: dict, label: str, primary: bool) -> list[dict]:
    out = []

    def get(w, t, k):
        r = runs.get(w, {}).get(t)
        return None if r is None or "error" in r else r.get(k)

    # 256 streams at 20 ms/token ask for 12,800 tokens/s. When even the direct run falls well
    # short, the simulator and load generator saturate the machine, and what the proxy adds
    # to throughput and TTFT drowns in that contention: the comparison is then inconclusive.
    ideal = 256 / 0.02
    direct_tps = get("stream-256x20ms", "direct", "tokens_per_s")
    saturated = direct_tps is not None and direct_tps < 0.9 * ideal
    why = (f"inconclusive: direct reached {direct_tps:,.0f} of {ideal:,.0f} tokens/s, the machine is saturated"
           if saturated else "")
    names = [x["name"] for x in results["targets"]]
    missing = results.get("missing", {})

    def unmeasured(what: str, baseline: str) -> dict:
        """A target compared with a baseline that did not run: listed, not left out."""
        return {"what": what, "measured": NOT_MEASURED, "met": None,
                "why": f"{NOT_MEASURED}: {baseline}: {missing[baseline]}"}

    # nginx's figures under the same conditions, as a reference for what the machine allows
    for t in [n for n in names if n.startswith("llmgw")] + [n for n in names if n == "nginx"]:
        reference = t == "nginx"
        dt, rt = get("stream-256x20ms", "direct", "tokens_per_s"), get("stream-256x20ms", t, "tokens_per_s")
        if "direct" in missing and t != "direct":
            out.append(unmeasured(f"{t}: 256 streams x 20 ms token throughput >= 0.95 of direct ({label})", "direct"))
        if dt and rt:
            out.append({"what": f"{t}: 256 streams x 20 ms token throughput >= 0.95 of direct ({label})",
                        "measured": f"{rt / dt:.3f}", "met": None if saturated or reference else rt / dt >= 0.95,
                        "why": "reference, not a target" if reference else why})
        d99, r99 = get("stream-256x20ms", "direct", "ttft_p99_ms"), get("stream-256x20ms", t, "ttft_p99_ms")
        d50, r50 = get("stream-256x20ms", "direct", "ttft_p50_ms"), get("stream-256x20ms", t, "ttft_p50_ms")
        if d99 is not None and r99 is not None:
            # p50 beside p99: under saturation the p99 difference can even be negative (the proxy's
            # accept queue smooths the burst the simulator would otherwise see), which says nothing
            # about the latency a request pays for passing through the proxy
            p50 = f" (p50: {r50 - d50:+.2f} ms" if d50 is not None and r50 is not None else " ("
            p50 += f"; most stolen from one CPU: direct {_stolen(runs, 'direct')}, {t} {_stolen(runs, t)})"
            out.append({"what": f"{t}: TTFT p99 overhead <= 5 ms (256 streams x 20 ms, {label})",
                        "measured": f"{r99 - d99:+.2f} ms{p50}",
                        "met": None if saturated or reference else r99 - d99 <= 5,
                        "why": "reference, not a target" if reference else why})
        if not primary or reference:
            continue
        for w in ("stream-64", "stream-256x20ms"):
            nc, rc = get(w, "nginx", "proxy_cpu_per_chunk_us"), get(w, t, "proxy_cpu_per_chunk_us")
            if "nginx" in missing and w in runs:
                out.append(unmeasured(f"{t}: CPU per streamed chunk <= 2x nginx ({w})", "nginx"))
            if nc and rc:
                out.append({"what": f"{t}: CPU per streamed chunk <= 2x nginx ({w})",
                            "measured": f"{rc / nc:.2f}x", "met": rc / nc <= 2})
        for w in ("small-c16", "small-c64"):
            lr, rr = get(w, "litellm", "rps"), get(w, t, "rps")
            if "litellm" in missing and w in runs:
                out.append(unmeasured(f"{t}: requests/s >= 3x LiteLLM ({w})", "litellm"))
            if lr and rr:
                out.append({"what": f"{t}: requests/s >= 3x LiteLLM ({w})",
                            "measured": f"{rr / lr:.2f}x", "met": rr / lr >= 3})
    return out


def overhead_notes(results: dict) -> list[str]:
    """How the router compares with the bare aiohttp relay: its own logic versus aiohttp's."""
    out = []
    runs = results["runs"]
    for w, key, what in (("small-c16", "proxy_cpu_per_request_us", "CPU per request"),
                         ("stream-64", "proxy_cpu_per_chunk_us", "CPU per chunk"),
                         ("stream-256x20ms", "proxy_cpu_per_chunk_us", "CPU per chunk")):
        bare = runs.get(w, {}).get("aiohttp-bare", {}).get(key)
        for t in ("llmgw-1w",):
            mine = runs.get(w, {}).get(t, {}).get(key)
            nginx = runs.get(w, {}).get("nginx", {}).get(key)
            if bare and mine:
                extra = f"; the bare relay alone is {bare / nginx:.2f}x nginx" if nginx else ""
                out.append(f"{w}: {t} {what} is {mine / bare:.2f}x the bare aiohttp relay's{extra}.")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short runs (smoke test of the harness)")
    ap.add_argument("--skip", default="", help="comma-separated targets to leave out (nginx, litellm, ...)")
    ap.add_argument("--only", default="",
                    help="comma-separated targets to run, the others left out (e.g. nginx,aiohttp-bare,llmgw-1w); "
                         "the prefix-affinity part runs only if 'prefix' is named")
    ap.add_argument("--workloads", default="",
                    help="comma-separated workloads to run (e.g. stream-64,stream-256x20ms); default all")
    ap.add_argument("--repeat", type=int, default=1,
                    help="measure each workload N times per target, the targets taken in turn each round (to see "
                         "the noise); the report keeps the median run by CPU per chunk (per request for "
                         "non-streaming; of two, the higher) and lists every run's figure")
    ap.add_argument("--limits", action="store_true",
                    help="add llmgw-1w-key and llmgw-1w-limits: the router with the client's key configured, without "
                         "and with per-key limits (none reached): what limits cost per request")
    ap.add_argument("--engine-tls", action="store_true",
                    help="add llmgw-1w-tls: the router to simulators serving HTTPS with an engine certificate it "
                         "verifies against the CA (compare with llmgw-1w for what TLS to the engine costs)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "router"))
    ap.add_argument("--report-only", metavar="JSON", help="rebuild the .md (and checks) from an earlier .json")
    ap.add_argument("--layout", choices=("both", "isolated", "shared"), default="both",
                    help="isolated: the proxy on its own CPU(s), simulators and load generator on the others; "
                         "shared: every process on every CPU; both (default): every workload isolated, then "
                         f"{', '.join(LAYOUT_WORKLOADS)} again shared")
    args = ap.parse_args(argv)
    if args.report_only:
        results = json.loads(Path(args.report_only).read_text())
        results["checks"] = checks(results)
        out = Path(args.out)
        out.with_suffix(".json").write_text(json.dumps(results, indent=2))
        out.with_suffix(".md").write_text(report(results))
        return 0
    skip = {s for s in args.skip.split(",") if s}
    only = {s for s in args.only.split(",") if s}
    if only:
        skip |= {n for n in ("direct", "nginx", "litellm", "aiohttp-bare", "llmgw-1w", "llmgw-2w", "llmgw-1w-tls",
                             "llmgw-1w-key", "llmgw-1w-limits", "prefix")
                 if n not in only}
    if not args.engine_tls:
        skip.add("llmgw-1w-tls")
    if not args.limits:
        skip |= {"llmgw-1w-key", "llmgw-1w-limits"}
    allowed = sorted(os.sched_getaffinity(0))
    ncpu = len(allowed)
    layouts = {"both": ["isolated", "shared"], "isolated": ["isolated"], "shared": ["shared"]}[args.layout]
    early_notes = []
    if ncpu < 2 and "isolated" in layouts:
        layouts = ["shared"]
        early_notes.append("One CPU: the proxy cannot have a CPU of its own, so everything ran shared.")
    cpus_proxy = cpus_up = None
    placement = "shared (the scheduler spreads simulators, proxy and load generator over all CPUs)"
    n_proxy = max(1, ncpu // 4)
    if layouts[0] == "isolated":
        cpus_up = ",".join(map(str, allowed[:-n_proxy]))
        cpus_proxy = ",".join(map(str, allowed[-n_proxy:]))
        placement = (f"proxy on CPU {cpus_proxy}; simulators and load generator on CPU {cpus_up}"
                     + ("; then shared (all on every CPU) for " + ", ".join(LAYOUT_WORKLOADS)
                        if "shared" in layouts else ""))
        if n_proxy < 2:
            early_notes.append("With the proxy on one CPU, llmgw-2w's two workers share it: its rows show what a "
                               "second process costs, not how the router scales over cores (that needs a host "
                               "with at least 8 CPUs here, where the proxy gets two).")
    workdir = Path(tempfile.mkdtemp(prefix="llmgw-bench-"))
    t_start = time.monotonic()
    results: dict[str, Any] = {
        "meta": {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "cpus": ncpu, "cpu_model": _cpu_model(),
                 "python": platform.python_version(), "kernel": platform.release(), "quick": args.quick,
                 "placement": placement, "layouts": layouts, "flags": _flags(args)},
        "targets": [], "workloads": [], "runs": {}, "notes": early_notes,
        "missing": {},  # requested targets that could not start: name -> why
    }
    procs: list[Proc] = []
    try:
        fast_p, fast = start_sim("fast", {}, workdir, cpus_up)
        slow_p, slow = start_sim("slow", {"LLMGW_SIM_TOKEN_LATENCY": "0.02"}, workdir, cpus_up)
        procs += [fast_p, slow_p]
        direct = Target("direct", fast, None, "client straight to the simulator")
        direct.url_slow = slow  # type: ignore[attr-defined]
        eps = [{"id": "fast0", "model": "fast", "url": fast}, {"id": "slow0", "model": "slow", "url": slow}]
        starters = [
            ("direct", lambda: direct),
            ("nginx", lambda: start_nginx(fast, slow, workdir, cpus_proxy)),
            ("litellm", lambda: start_litellm(fast, slow, workdir, cpus_proxy)),
            ("aiohttp-bare", lambda: start_bare(fast, slow, workdir, cpus_proxy)),
            ("llmgw-1w", lambda: start_llmgw("llmgw-1w", eps, 1, workdir, cpus_proxy)),
            ("llmgw-2w", lambda: start_llmgw("llmgw-2w", eps, 2, workdir, cpus_proxy)),
            ("llmgw-1w-tls", lambda: start_llmgw_tls(workdir, cpus_up, cpus_proxy, procs)),
            ("llmgw-1w-key", lambda: start_llmgw_key("llmgw-1w-key", eps, workdir, cpus_proxy, False)),
            ("llmgw-1w-limits", lambda: start_llmgw_key("llmgw-1w-limits", eps, workdir, cpus_proxy, True)),
        ]
        wls = workloads(args.quick)
        if args.workloads:
            wanted = args.workloads.split(",")
            unknown = set(wanted) - {w.name for w in wls}
            if unknown:
                raise SystemExit(f"unknown workload(s): {', '.join(sorted(unknown))}")
            wls = [w for w in wls if w.name in wanted]
        results["workloads"] = [w.__dict__ for w in wls]
        # Every target is started first and stays up; each workload's repeats then go round the
        # targets (A B C, A B C, ...), so a target's figure and the one it is compared with are
        # measured minutes apart at most, not a whole target's run apart: on a shared machine the
        # same process's CPU per chunk drifts by more than the differences being judged.
        running: list[Target] = []
        try:
            for name, start in starters:
                if name in skip:
                    continue
                print(f"[{time.monotonic() - t_start:6.1f}s] starting {name}", flush=True)
                try:
                    t = start()
                except Exception as e:  # noqa: BLE001 - a target that cannot start is reported, not fatal
                    results["missing"][name] = (str(e).splitlines() or [type(e).__name__])[0]
                    print(f"[{time.monotonic() - t_start:6.1f}s] MISSING {name}: {results['missing'][name]}; "
                          "comparisons with it are not measured", flush=True)
                    continue
                results["targets"].append({"name": t.name, "note": t.note})
                running.append(t)
            for t in running:
                warm(t, cpus_up)
            for w in wls:
                for name, r in measure_round(w, running, cpus_up, args.repeat, t_start).items():
                    results["runs"].setdefault(w.name, {})[name] = r
            if len(layouts) > 1:
                # Shared layout for the workloads whose judged figures depend on placement: the
                # running processes are moved, not restarted, so nothing but placement changes.
                for proc in [*procs, *(t.proc for t in running if t.proc)]:
                    move_tree(proc.proc.pid, set(allowed))
                for w in [w for w in wls if w.name in LAYOUT_WORKLOADS]:
                    results.setdefault("runs_shared", {})[w.name] = measure_round(w, running, None, args.repeat,
                                                                                  t_start, "shared ")
        finally:
            for t in running:
                if t.proc:
                    t.proc.stop()
        if "prefix" not in skip:
            print(f"[{time.monotonic() - t_start:6.1f}s] prefix affinity", flush=True)
            results["prefix_affinity"] = prefix_affinity(workdir, args.quick, cpus_up, cpus_proxy)
    finally:
        for p in procs:
            p.stop()
    results["elapsed_s"] = time.monotonic() - t_start
    results["checks"] = checks(results)
    results["notes"] += overhead_notes(results)
    results["notes"] += [
        f"Whole run took {results['elapsed_s']:.0f} s.",
        "nginx cannot route on the JSON body's model, so it is given one location per model; the other proxies "
        "route by the body's `model` on one port.",
    ]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2))
    out.with_suffix(".md").write_text(report(results))
    for line in missing_lines(results):
        print(f"missing baseline: {line}")
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')} in {results['elapsed_s']:.0f}s")
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


def _flags(args: argparse.Namespace) -> str:
    """The options that shaped the run, as they would be typed (for the report's first line)."""
    out = ""
    if args.quick:
        out += " --quick"
    if args.engine_tls:
        out += " --engine-tls"
    if args.limits:
        out += " --limits"
    for name in ("skip", "only", "workloads"):
        if getattr(args, name):
            out += f" --{name} {getattr(args, name)}"
    if args.repeat > 1:
        out += f" --repeat {args.repeat}"
    if args.layout != "both":
        out += f" --layout {args.layout}"
    return out


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return re.sub(r"\s+", " ", line.split(":", 1)[1]).strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
