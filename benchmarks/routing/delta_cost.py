"""The control plane's CPU per 1,000 route-key deltas, and the relay's per 1,000 KV events.

Control plane: each ``kv_routes`` message as the stream delivers it (text), checked as every
agent message is (``messages.parse_up``: JSON, the stream schema), applied to the bounded book
(``controlplane.routekeys``), then read back as deltas by ``--readers`` router polls (``since``
and the answer's JSON, what the watch does per poll). Relay: the simulator's KV cache under a
shared-prefix workload publishes its events, encoded as vLLM encodes them; the relay decodes
them, keys the blocks and coalesces the changes into upstream messages.

    PYTHONPATH=agent python benchmarks/routing/delta_cost.py [--keys 100000] [--readers 4]

Process CPU time (``time.process_time``), one core, no sockets: the cost per delta, not a
throughput under load.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from llmgw.agent.kvrelay_map import RouteMap
from llmgw.agent.kvrelay_outbox import Outbox, Pending
from llmgw.controlplane.messages import parse_up
from llmgw.controlplane.routekeys import RouteKeyBook
from llmgw.kvevents import EventBatch, decode_batch, encode_batch
from llmgw.kvroutekeys import to_hex
from llmgw.sim.sim_kvcache import KVCache


def control_plane(keys: int, per_message: int, readers: int, replicas: int) -> dict[str, float]:
    rng = random.Random(1)
    book = RouteKeyBook(lambda n, s: s.removesuffix("/r0"))
    msgs = []
    deltas = 0
    held: dict[str, list[int]] = {f"rep{i}": [] for i in range(replicas)}
    for m in range(keys // per_message):
        rid = f"rep{m % replicas}"
        added = [rng.getrandbits(64) for _ in range(per_message // 2)]
        removed = held[rid][: per_message - len(added)]
        held[rid] = held[rid][len(removed):] + added
        deltas += len(added) + len(removed)
        msgs.append(json.dumps({"type": "kv_routes", "replicas": [
            {"replica_id": rid, "shard_id": f"{rid}/r0", "added": [to_hex(k) for k in added],
             "removed": [to_hex(k) for k in removed]}]}, separators=(",", ":")))
    after = [book.revision] * readers
    t0 = time.process_time()
    for text in msgs:
        book.apply("n", parse_up(text))
    t1 = time.process_time()
    for i in range(readers):
        while after[i] < book.revision:
            after[i], _, replicas = book.since(after[i], book.epoch)
            json.dumps({"route_keys": {"replicas": replicas}})  # the watch answer's encoding
    t2 = time.process_time()
    return {"deltas": deltas, "messages": len(msgs), "apply_ms_per_1000": 1000 * (t1 - t0) / deltas * 1000,
            "read_ms_per_1000_per_reader": 1000 * (t2 - t1) / deltas * 1000 / max(readers, 1)}


def relay(requests: int) -> dict[str, float]:
    rng = random.Random(2)
    cache = KVCache(num_blocks=2000, block_size=16, record_events=True)
    systems = [[rng.randrange(1, 50000) for _ in range(512)] for _ in range(20)]
    payloads = []
    for _ in range(requests):
        prompt = rng.choice(systems) + [rng.randrange(1, 50000) for _ in range(rng.randrange(32, 400))]
        a = cache.admit(prompt, 64)
        if a is not None:
            cache.release(a, [rng.randrange(1, 50000) for _ in range(64)])
        events = cache.drain()
        if events:
            payloads.append(encode_batch(EventBatch(0.0, tuple(events))))
    out = Outbox()
    rmap: RouteMap | None = None
    pending = Pending("rep", "rep/r0", current=lambda: rmap.keys() if rmap else [])
    out.replicas["rep/r0"] = pending
    rmap = RouteMap(pending)
    sent = bytes_up = events = 0
    t0 = time.process_time()
    for i, p in enumerate(payloads):
        batch = decode_batch(p)
        events += len(batch.events)
        rmap.apply(batch.events)
        if i % 10 == 9:  # a message every few engine steps, as the pacing allows
            while (msg := out.take(1024)) is not None:
                sent += 1
                bytes_up += len(json.dumps(msg, separators=(",", ":")))
    t1 = time.process_time()
    return {"events": events, "messages": sent, "cpu_ms_per_1000_events": 1000 * (t1 - t0) / events * 1000,
            "bytes_up_per_1000_events": bytes_up / events * 1000}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--per-message", type=int, default=256)
    ap.add_argument("--readers", type=int, default=4)
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--requests", type=int, default=3000)
    a = ap.parse_args()
    print(json.dumps({"control_plane": control_plane(a.keys, a.per_message, a.readers, a.replicas),
                      "relay": relay(a.requests)}, indent=1))


if __name__ == "__main__":
    main()
