"""Prefix-cache emulation: chained block hashes, longest cached prefix, LRU capacity."""

from llmgw.sim.sim_prefix import PrefixCache, block_hashes


def words(n, start=0):
    return [f"w{i}" for i in range(start, start + n)]


def test_only_full_blocks_are_hashed_and_chained():
    assert len(block_hashes(words(47), 16)) == 2
    a = block_hashes(words(32), 16)
    b = block_hashes(["x"] + words(31, 1), 16)
    # A different first block changes every later hash, even with identical second blocks.
    assert a[0] != b[0] and a[1] != b[1]
    assert block_hashes(words(32), 16) == a


def test_repeated_prompt_hits_every_block_but_the_one_holding_the_last_token():
    cache = PrefixCache(capacity_blocks=100, block_size=16)
    prompt = words(48)
    assert cache.lookup_and_insert(prompt) == 0
    # 48 tokens = 3 full blocks, but the last token must be recomputed: 2 blocks hit.
    assert cache.lookup_and_insert(prompt) == 32
    assert (cache.queries, cache.hits) == (96, 32)


def test_shared_prefix_hits_until_the_first_difference():
    cache = PrefixCache(capacity_blocks=100, block_size=4)
    cache.lookup_and_insert(words(12))
    other = words(8) + ["different"] + words(7, 100)
    assert cache.lookup_and_insert(other) == 8


def test_lru_evicts_the_least_recently_used_blocks():
    cache = PrefixCache(capacity_blocks=2, block_size=4)
    first, second = words(5), words(5, 50)
    cache.lookup_and_insert(first)
    cache.lookup_and_insert(second)
    assert len(cache) == 2
    cache.lookup_and_insert(words(5, 90))  # a third block evicts `first`, the oldest
    assert cache.lookup_and_insert(first) == 0
    assert cache.lookup_and_insert(words(5, 90)) == 4


def test_disabled_cache_counts_nothing():
    cache = PrefixCache(capacity_blocks=10, block_size=4, enabled=False)
    cache.lookup_and_insert(words(20))
    assert cache.lookup_and_insert(words(20)) == 0
    assert (cache.queries, cache.hits) == (0, 0)
