"""Where each scorer sends a shared-prefix workload, and what the engines' caches make of it.

A workload shaped like llm-d's ``73-capacity`` benchmark, scaled down: ``--groups`` groups each
share a system prompt of ``--system`` tokens; ``--users`` users per group hold multi-turn
conversations (each turn a ``--question``-token question; the answer, ``--answer`` tokens, joins
the history). ``--replicas`` replicas each keep the simulator's KV model
(``llmgw.sim.sim_kvcache``: vLLM's block pool, prefix cache and LRU eviction) of ``--kv-tokens``
tokens. Requests arrive in a random order; each replica's load is the requests it took among
the last ``--window`` (a stand-in for what is in flight).

The route keys travel the whole way they do in a fleet, without the sockets: the engine's KV
events, encoded as vLLM encodes them, into the agent relay's map and outbox
(``agent/kvrelay_map``, ``kvrelay_outbox``), its ``kv_routes`` messages checked and applied by the
control plane's book (``controlplane/routekeys``), read back as the watch reads them into the
router's index (``router/kvindex``), every ``--lag`` requests (the relay's and the watch's
batching).

Reported per scorer: the engines' own prefix-cache hit rate (hit tokens / prompt tokens, as
``vllm:prefix_cache_hits`` / ``queries`` count them), how far the cache-aware scorer's prediction
(held blocks x block size) was from the hits the chosen engine then reported, the share of
requests the index placed (the rest fell back to prefix affinity), and the router's CPU per
request in ``pick`` (hashing and the index lookup; the simulator tokenizer's time apart). This measures placement
and cache behaviour, not latency: TTFT and throughput under a QPS ladder need the fleet's real
processes (see docs/router.md).

    PYTHONPATH=agent python benchmarks/routing/placement.py            # the short form
    PYTHONPATH=agent python benchmarks/routing/placement.py --requests 20000 --groups 48
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import Counter, deque
from dataclasses import dataclass

from llmgw.agent.kvrelay_map import RouteMap
from llmgw.agent.kvrelay_outbox import Outbox, Pending
from llmgw.controlplane.messages import dumps, parse_up
from llmgw.controlplane.routekeys import RouteKeyBook
from llmgw.kvevents import EventBatch, decode_batch, encode_batch
from llmgw.kvroutekeys import chain_keys
from llmgw.router.balancing import CacheAware, LeastOutstanding, PrefixAffinity
from llmgw.router.kvindex import KVIndex
from llmgw.router.kvindex_tokens import simulator_token_ids
from llmgw.sim.sim_kvcache import KVCache

BS = 16


@dataclass
class Ep:
    model: str
    replica_id: str


@dataclass
class Member:
    id: str
    endpoint: Ep
    outstanding: int = 0


def workload(a: argparse.Namespace, rng: random.Random) -> list[list[int]]:
    """Prompts (token ids) in arrival order: every user's turns in order, users interleaved."""
    vocab = 900_000_000
    systems = [[rng.randrange(1, vocab) for _ in range(a.system)] for _ in range(a.groups)]
    convs = []
    for g in range(a.groups):
        for _ in range(a.users):
            history = list(systems[g])
            turns = []
            for _ in range(a.turns):
                history = history + [rng.randrange(1, vocab) for _ in range(a.question)]
                turns.append(history)
                history = history + [rng.randrange(1, vocab) for _ in range(a.answer)]
            convs.append(turns)
    order = []
    pending = [deque(c) for c in convs]
    while any(pending):
        live = [p for p in pending if p]
        order.append(rng.choice(live).popleft())
    return order[:a.requests]


class KeyPath:
    """Replica ``i``'s KV events (``r{i}``) into a router's index, the way a fleet carries them, without
    its sockets: the agent relay's map and outbox, ``kv_routes`` messages checked and applied by the
    control plane's book, read back as the watch reads them."""

    def __init__(self, replicas: int) -> None:
        self.maps, self.outbox = [], Outbox()
        for i in range(replicas):
            p = Pending(f"r{i}", f"r{i}/r0", current=lambda i=i: self.maps[i].keys())
            self.outbox.replicas[f"r{i}/r0"] = p
            self.maps.append(RouteMap(p))
        self.book = RouteKeyBook(lambda n, s: s.removesuffix("/r0"))
        self.index = KVIndex()

    def sync(self, now: float) -> None:
        while (msg := self.outbox.take(1024)) is not None:
            self.book.apply("n", parse_up(dumps(msg)))
        rev, full, reps = self.book.since(self.index.revision, self.index.epoch or None)
        self.index.apply({"epoch": self.book.epoch, "revision": rev, "full": full, "replicas": reps}, now)


class Fleet(KeyPath):
    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__(a.replicas)
        self.caches = [KVCache(num_blocks=a.kv_tokens // BS + 1, block_size=BS, record_events=True)
                       for _ in range(a.replicas)]
        self.members = [Member(f"e{i}", Ep("m", f"r{i}")) for i in range(a.replicas)]
        self.recent: deque[int] = deque(maxlen=a.window)

    def serve(self, i: int, prompt: list[int], answer: int) -> int:
        """The request on replica ``i``: the hit tokens its cache reports."""
        cache = self.caches[i]
        before = cache.hits
        alloc = cache.admit(prompt, answer)
        if alloc is None:  # the cache is too small for it: counted as a miss
            cache.queries += len(prompt)
            return 0
        cache.release(alloc, [1] * answer)
        events = cache.drain()
        if events:
            self.maps[i].apply(decode_batch(encode_batch(EventBatch(0.0, tuple(events)))).events)
        self.recent.append(i)
        for m in self.members:
            m.outstanding = 0
        for j, n in Counter(self.recent).items():
            self.members[j].outstanding = n
        return cache.hits - before


def run(name: str, a: argparse.Namespace, prompts: list[list[int]]) -> dict[str, float | None]:
    fleet = Fleet(a)
    rng = random.Random(7)
    affinity = PrefixAffinity(256, 1.25, rng)
    tokenizing = [0.0]

    def tokenize(payload, n):  # timed apart: tokenization is the engine's business, the index is ours
        t0 = time.process_time()
        try:
            return simulator_token_ids(payload, n)
        finally:
            tokenizing[0] += time.process_time() - t0

    scorer = {"least-outstanding": LeastOutstanding(rng), "prefix-affinity": affinity,
              "cache-aware": CacheAware(fleet.index, tokenize, BS, 8192, affinity, clock=lambda: 0.0)}[name]
    cpu = 0.0
    errors = []
    for n, prompt in enumerate(prompts):
        payload = {"prompt": " ".join(map(str, prompt))}
        t0 = time.process_time()
        m = scorer.pick(fleet.members, lambda m: True, payload)
        cpu += time.process_time() - t0
        i = fleet.members.index(m)
        predicted = None
        if isinstance(scorer, CacheAware) and fleet.index.fresh(m.endpoint.replica_id, 0.0):
            predicted = fleet.index.held_prefix(m.endpoint.replica_id, chain_keys(prompt, BS)) * BS
        hit = fleet.serve(i, prompt, a.answer)
        if predicted is not None:
            # the engine recomputes a fully cached prompt's last token: compare like with like
            errors.append((min(predicted, (len(prompt) - 1) // BS * BS), hit))
        if n % a.lag == a.lag - 1:
            fleet.sync(0.0)
    queries = sum(c.queries for c in fleet.caches)
    hits = sum(c.hits for c in fleet.caches)
    tokens = sum(map(len, prompts))
    out: dict[str, float | None] = {
        "hit_rate": round(hits / queries, 4),
        "router_cpu_us_per_request": round((cpu - tokenizing[0]) / len(prompts) * 1e6, 1),
        "router_cpu_us_per_10k_prompt_tokens": round((cpu - tokenizing[0]) / tokens * 1e10, 1)}
    if tokenizing[0]:
        out["tokenize_cpu_us_per_request"] = round(tokenizing[0] / len(prompts) * 1e6, 1)
    if errors:
        pred = sum(p for p, _ in errors)
        act = sum(h for _, h in errors)
        out["predicted_vs_actual_hits"] = round(pred / act, 4) if act else None
    if isinstance(scorer, CacheAware):
        out["placed_by_index"] = round(scorer.precise / len(prompts), 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--groups", type=int, default=24)
    ap.add_argument("--users", type=int, default=5)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system", type=int, default=1200)
    ap.add_argument("--question", type=int, default=240)
    ap.add_argument("--answer", type=int, default=100)
    ap.add_argument("--kv-tokens", type=int, default=16384)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--lag", type=int, default=4)
    ap.add_argument("--requests", type=int, default=360)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    prompts = workload(a, random.Random(a.seed))
    result = {"args": vars(a), "prompt_tokens_mean": round(sum(map(len, prompts)) / len(prompts))}
    for name in ("least-outstanding", "prefix-affinity", "cache-aware"):
        result[name] = run(name, a, prompts)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
