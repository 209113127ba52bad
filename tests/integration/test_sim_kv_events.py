"""The engine simulator's KV cache and KV events, through a real simulator process.

Started as vLLM is (``--enable-prefix-caching --kv-events-config '<JSON>'`` with ipc://
endpoints), with a KV cache of 9 blocks of 16 tokens (8 usable). A pyzmq SUB socket and a
DEALER on the replay socket read what it publishes, decoded by llmgw.kvevents: prompts sharing a
prefix store chained blocks, the prefix-cache counters on /metrics agree, a full cache evicts
(BlockRemoved), a subscriber that was away gets what it missed by sequence number, and a request
whose blocks are not free waits (vllm:num_requests_waiting) until they are.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import threading
from itertools import count
from pathlib import Path

import httpx
import pytest

zmq = pytest.importorskip("zmq")

from llmgw.kvevents import BlockRemoved, BlockStored  # noqa: E402
from tests.integration.simproc import start_sim  # noqa: E402
from tests.support.kvsub import Subscriber, replay  # noqa: E402
from tests.support.polling import until  # noqa: E402

pytestmark = pytest.mark.integration

TOPIC = "kv@sim@m"
BS = 16
SHARED = [1000 + i for i in range(2 * BS)]  # two full blocks
_unique = count(1)


def tail(seed: int, n: int = BS) -> list[int]:
    return [5000 + seed * 100 + i for i in range(n)]


def kv_config(d: Path, endpoint: str | None = None) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": endpoint or f"ipc://{d}/kv.sock",
                       "replay_endpoint": f"ipc://{d}/kv-replay.sock", "topic": TOPIC})


@pytest.fixture(scope="module")
def engine():
    d = Path(tempfile.mkdtemp(prefix="simkv-"))  # ipc:// paths must stay short (108 bytes)
    sim = start_sim("m", env={"LLMGW_SIM_TOKEN_LATENCY": "0.01"}, extra_args=[
        "--enable-prefix-caching", "--block-size", str(BS), "--num-gpu-blocks-override", "9",
        "--kv-events-config", kv_config(d)])
    ctx = zmq.Context()
    yield sim, d, ctx
    ctx.destroy(linger=0)
    sim.stop()
    shutil.rmtree(d, ignore_errors=True)


def complete(sim, prompt: list[int], max_tokens: int = 1) -> dict:
    r = httpx.post(f"{sim.base_url}/completions", timeout=60,
                   json={"model": "m", "prompt": prompt, "max_tokens": max_tokens})
    r.raise_for_status()
    return r.json()


def metric(sim, name: str) -> float:
    text = httpx.get(f"{sim.url}/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def waiting_for(sim, reason: str) -> float:
    text = httpx.get(f"{sim.url}/metrics", timeout=30).text
    (value,) = re.findall(rf'^vllm:num_requests_waiting_by_reason{{[^}}]*reason="{reason}"[^}}]*}} (\S+)$', text, re.M)
    return float(value)


def joined(sim, sub: Subscriber) -> None:
    """PUB/SUB drops what is published before the subscription reaches the publisher: send
    throwaway one-block prompts until one's event arrives."""
    def probe():
        complete(sim, tail(100 + next(_unique)) + [1])
        try:
            return until(sub.pump, "an event", timeout=2, error=TimeoutError)
        except TimeoutError:
            return None
    until(probe, "the subscription to reach the publisher", interval=0)


def test_shared_prefix_chains_counters_evictions_and_replay_after_a_subscriber_restart(engine):
    sim, d, ctx = engine
    sub = Subscriber(ctx, f"ipc://{d}/kv.sock", TOPIC)
    joined(sim, sub)

    a, b = SHARED + tail(1) + [7], SHARED + tail(2) + [7]
    q0, h0 = metric(sim, "vllm:prefix_cache_queries_total"), metric(sim, "vllm:prefix_cache_hits_total")
    complete(sim, a)
    (first,) = until(lambda: sub.stored(a[:3 * BS]), "the first prompt's BlockStored")
    assert first.parent_block_hash is None and len(first.block_hashes) == 3 and first.block_size == BS
    complete(sim, b)
    # only the block after the shared 32 tokens is new, chained to the second shared block
    (second,) = until(lambda: sub.stored(b[2 * BS:3 * BS]), "the second prompt's BlockStored")
    assert second.parent_block_hash == first.block_hashes[1]
    # the counters agree: the second prompt hit exactly the shared blocks
    assert metric(sim, "vllm:prefix_cache_hits_total") - h0 == 2 * BS
    assert metric(sim, "vllm:prefix_cache_queries_total") - q0 == len(a) + len(b)
    assert complete(sim, b)["usage"]["prompt_tokens"] == len(b)
    assert metric(sim, "vllm:prefix_cache_hits_total") - h0 == 2 * BS + 3 * BS
    seqs = [m.seq for m in sub.got]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))

    # the subscriber goes away; a third prompt extends the chain, and then one that needs the
    # whole cache (8 blocks) evicts every cached block, while nobody listens
    last = sub.got[-1].seq
    sub.close()
    c = b[:3 * BS] + tail(3) + [7]
    complete(sim, c)
    big = tail(50, 8 * BS)
    complete(sim, big)
    missed = replay(ctx, f"ipc://{d}/kv-replay.sock", last + 1, wait=30)
    assert [m.seq for m in missed] == list(range(last + 1, last + 1 + len(missed)))
    assert {m.topic for m in missed} == {TOPIC}
    events = [e for m in missed for e in m.batch.events]
    (third,) = [e for e in events if isinstance(e, BlockStored) and e.parent_block_hash == second.block_hashes[0]]
    assert third.token_ids == tuple(c[3 * BS:4 * BS])
    removed = {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert set(first.block_hashes) | set(second.block_hashes) | set(third.block_hashes) <= removed
    assert [e for e in events if isinstance(e, BlockStored) and e.token_ids == tuple(big)]
    # evicted: the shared prefix is no longer a hit
    h1 = metric(sim, "vllm:prefix_cache_hits_total")
    complete(sim, a)
    assert metric(sim, "vllm:prefix_cache_hits_total") == h1

    # a restarted subscriber catches up from 0: every batch, in order, no gap, the ones seen equal
    everything = replay(ctx, f"ipc://{d}/kv-replay.sock", 0, wait=30)
    assert [m.seq for m in everything] == list(range(len(everything)))
    assert everything[seqs[0]:seqs[0] + len(seqs)] == sub.got


def test_a_request_waits_while_the_blocks_it_needs_are_held(engine):
    sim, _, _ = engine
    assert metric(sim, "vllm:num_requests_waiting") == 0
    done = threading.Event()
    results = []

    def hog():
        # 16 prompt tokens + 5000 to generate: more than the 8 usable blocks, so it holds them all,
        # streaming until the test has seen the other request wait, then hanging up (which frees them)
        body = {"model": "m", "prompt": tail(70), "max_tokens": 5000, "stream": True}
        with httpx.stream("POST", f"{sim.base_url}/completions", json=body, timeout=60) as r:
            for _ in r.iter_lines():
                if done.is_set():
                    break

    holder = threading.Thread(target=hog)
    waiter = threading.Thread(target=lambda: results.append(complete(sim, tail(71) + [1])))
    holder.start()
    try:
        until(lambda: metric(sim, "vllm:kv_cache_usage_perc") == 1.0, "the first request to hold the cache")
        waiter.start()
        until(lambda: metric(sim, "vllm:num_requests_waiting") == 1, "the second request to wait for blocks")
        assert metric(sim, "vllm:num_requests_running") == 1 and not results
        assert waiting_for(sim, "capacity") == 1 and waiting_for(sim, "deferred") == 0
    finally:
        done.set()
        holder.join(60)
        if waiter.is_alive():
            waiter.join(60)
    assert len(results) == 1 and results[0]["usage"]["completion_tokens"] == 1
    until(lambda: metric(sim, "vllm:kv_cache_usage_perc") == 0.0, "every block to be free again")
    assert metric(sim, "vllm:num_requests_waiting") == 0


def test_tcp_wildcard_endpoints_are_refused_before_anything_listens(tmp_path):
    sim = start_sim("m", wait=False, extra_args=["--kv-events-config", kv_config(tmp_path, "tcp://*:5557")])
    assert sim.wait(30) == 1
    assert "ValueError: Invalid endpoint: kv_events_config.endpoint 'tcp://*:5557' binds every network " \
           "interface" in sim.output()


def test_without_pyzmq_the_flag_fails_with_a_clear_message(tmp_path):
    fake = tmp_path / "nozmq" / "zmq"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named zmq')\n")
    agent = str(Path(__file__).resolve().parents[2] / "agent")
    sim = start_sim("m", wait=False, env={"PYTHONPATH": f"{fake.parent}:{agent}"},
                    extra_args=["--kv-events-config", kv_config(tmp_path)])
    assert sim.wait(30) == 1
    assert "--kv-events-config needs pyzmq" in sim.output()
    # without the flag the same interpreter serves: zmq is imported only when asked for
    plain = start_sim("m", env={"PYTHONPATH": f"{fake.parent}:{agent}"})
    try:
        assert complete(plain, [1, 2, 3])["usage"]["prompt_tokens"] == 3
    finally:
        plain.stop()
