"""Prefix-cache emulation in the manner of vLLM's automatic prefix caching.

vLLM hashes a prompt in fixed-size blocks of tokens, each block's hash
chained to its parent's, so a block is reusable only when everything before
it is identical.  Only full blocks are cached.  On a lookup the longest run
of cached leading blocks is a hit, capped so that at least one prompt token is
still computed (vLLM needs the last token's logits).  Counters are in tokens:
``queries`` grows by the prompt length, ``hits`` by the cached tokens, which is
what vllm:prefix_cache_queries / vllm:prefix_cache_hits count.

Eviction is least-recently-used over block hashes, with a fixed capacity.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Sequence

_ROOT = b"llmgw-sim-prefix-root"


def block_hashes(tokens: Sequence[str], block_size: int) -> list[bytes]:
    """Chained hashes of every full block of ``tokens``."""
    hashes = []
    parent = _ROOT
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = "\x1f".join(tokens[start:start + block_size]).encode()
        parent = hashlib.blake2b(parent + b"\x00" + block, digest_size=16).digest()
        hashes.append(parent)
    return hashes


class PrefixCache:
    def __init__(self, capacity_blocks: int, block_size: int = 16, enabled: bool = True) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.capacity = capacity_blocks
        self.block_size = block_size
        self.enabled = enabled and capacity_blocks > 0
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self.queries = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._lru)

    def lookup_and_insert(self, tokens: Sequence[str]) -> int:
        """Count a prompt's lookup, cache its blocks, return the cached-token count."""
        if not self.enabled:
            return 0
        hashes = block_hashes(tokens, self.block_size)
        max_blocks = max(len(tokens) - 1, 0) // self.block_size
        hit_blocks = 0
        for h in hashes[:max_blocks]:
            if h not in self._lru:
                break
            hit_blocks += 1
        hit_tokens = hit_blocks * self.block_size
        self.queries += len(tokens)
        self.hits += hit_tokens
        for h in hashes:
            if h in self._lru:
                self._lru.move_to_end(h)
            else:
                self._lru[h] = None
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)
        return hit_tokens
