"""The simulator's KV cache: vLLM's block pool and prefix cache, without a GPU.

What is modelled, after ``vllm/v1/core/block_pool.py`` and ``kv_cache_utils.py`` (0.32/0.33):

* **Blocks** of ``block_size`` tokens; ``num_blocks`` of them, one of which is vLLM's null
  block, so ``num_blocks - 1`` hold tokens (and ``kv_cache_usage_perc`` is over those).
* **Block hashes** chained exactly as vLLM chains them: a full block's hash is
  ``sha256(pickle((parent_hash or NONE_HASH, tuple(token_ids), extra_keys)))`` with
  ``NONE_HASH = sha256(pickle(seed))``, the seed being ``PYTHONHASHSEED`` or vLLM's fixed
  ``"vllm-none-hash"``. With the same seed and token ids the simulator's hashes are vLLM's own
  (``tests/unit/test_sim_kvcache.py`` checks them against frames captured from the real engine);
  KV events carry the low 64 bits, big-endian, as vLLM's ``maybe_convert_block_hash`` does.
* **Prefix-cache hits**: the longest run of leading full blocks whose hashes are cached (held by
  a running request or free but not yet reused), capped so the last prompt token is computed
  again (vLLM needs its logits). ``queries`` grows by the prompt length, ``hits`` by the cached
  tokens: ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``.
* **The free queue and LRU eviction**: a freed block that holds a cached hash goes to the back
  of the queue, one that holds none to the front, a request's blocks tail first; allocation
  takes from the front, and a cached block is evicted (``BlockRemoved``) only when its memory
  is taken for another request. Hence ``free`` = never-hashed blocks first, then cached blocks
  least recently used first, which is what this module keeps (a count and an ordered map).
* **A batch limited by KV space**: a request is admitted only when the blocks it needs are
  free; otherwise it waits (the caller queues it, first come first served).

Simplifications, each chosen to keep the per-request cost a few dict operations:

* a request reserves blocks for its whole sequence (prompt + the tokens it may generate) when
  admitted, so nothing is ever preempted; vLLM allocates while decoding and preempts when short;
* blocks filled by generated tokens are stored (one ``BlockStored`` each, as vLLM's decode steps
  publish them) when the request finishes, not in the step that fills them;
* a full block whose hash is already cached (the last prompt block of a fully cached prompt) is
  computed into a block of its own that stays unhashed; vLLM hashes the duplicate too and
  publishes a second ``BlockStored`` for the same hash.

Pure logic: no I/O, no clock. Events go to ``events`` (when ``record_events``) for the caller to
publish; ``llmgw.kvevents`` has their wire form.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from llmgw.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

DEFAULT_BLOCK_SIZE = 16  # vLLM's CacheConfig.DEFAULT_BLOCK_SIZE when --block-size is absent
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"  # vllm/v1/core/kv_cache_utils.py, for sha256
MEDIUM = "GPU"
SPEC_KIND = "full_attention"
_LOW64 = (1 << 64) - 1


def sha256_pickle(value: object) -> bytes:
    """vLLM's default prefix-caching hash (``--prefix-caching-hash-algo sha256``)."""
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def none_hash(env: Mapping[str, str] | None = None) -> bytes:
    """The chain's seed: what a first block's hash takes as its parent."""
    seed = (os.environ if env is None else env).get("PYTHONHASHSEED")
    return sha256_pickle(DEFAULT_NONE_HASH_SEED if seed is None else seed)


def hash_block(parent: bytes | None, token_ids: Sequence[int], root: bytes) -> bytes:
    """``hash_block_tokens``: the block's hash covers its parent's hash and its own tokens."""
    return _hash_block(parent or root, tuple(token_ids))


@functools.lru_cache(maxsize=1 << 14)
def _hash_block(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    # Memoized as vLLM memoizes it: shared prefixes hash the same blocks over and over, and the
    # pickling is most of a request's cost in the simulator.
    return sha256_pickle((parent, tokens, None))


def block_hashes(token_ids: Sequence[int], block_size: int, root: bytes, parent: bytes | None = None,
                 start: int = 0) -> list[bytes]:
    """Chained hashes of the full blocks of ``token_ids[start:]`` (``start`` on a block boundary)."""
    out = []
    for i in range(start, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[i:i + block_size], root)
        out.append(parent)
    return out


def external(h: bytes) -> int:
    """The hash as KV events carry it (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the default)."""
    return int.from_bytes(h, "big") & _LOW64


def token_id(word: str) -> int:
    """The simulator's vocabulary: a word of digits is that token id (prompts sent as ids keep
    them), any other word a stable 31-bit id."""
    if word.isdigit() and len(word) < 10:
        return int(word)
    return zlib.crc32(word.encode()) & 0x7FFFFFFF


_IDS: dict[str, int] = {}
_IDS_MAX = 1 << 16


def token_ids(words: Sequence[str]) -> list[int]:
    """Ids of a prompt's words, memoized: prompts repeat words, and this was a third of a
    request's cost in the simulator (a plain dict: an LRU's bookkeeping cost more than it saved)."""
    ids = _IDS
    try:
        return [ids[w] for w in words]
    except KeyError:
        pass
    if len(ids) > _IDS_MAX:
        ids.clear()
    out = []
    for w in words:
        i = ids.get(w)
        if i is None:
            i = ids[w] = token_id(w)
        out.append(i)
    return out


class KVConfigError(ValueError):
    """A cache the engine could not have (too few blocks, a bad block size)."""


@dataclass
class Allocation:
    """One admitted request's hold on the cache."""

    token_ids: list[int]  # the prompt's; generated ids are appended on release
    hashes: list[bytes]  # hashes of its full, cached blocks, in order (its chain)
    blocks: int  # blocks it holds: the cached ones in ``hashes`` plus unhashed ones
    cached_tokens: int  # prompt tokens found in the prefix cache
    new_blocks: list[bytes] = field(default_factory=list)  # hashes it stored itself
    chain_open: bool = True  # every full prompt block is hashed, so generated blocks can extend the chain


class KVCache:
    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE, *, enable_caching: bool = True,
                 record_events: bool = False, root: bytes | None = None) -> None:
        if block_size < 1:
            raise KVConfigError(f"block_size must be >= 1, got {block_size}")
        if num_blocks < 2:
            raise KVConfigError(f"the KV cache needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.usable = num_blocks - 1  # the null block holds nothing
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.record_events = record_events
        self.root = none_hash() if root is None else root
        self._uncached_free = self.usable  # free blocks holding no hash: reused first
        self._cached_free: OrderedDict[bytes, None] = OrderedDict()  # free, hashed, LRU first
        self._refs: dict[bytes, int] = {}  # every cached hash -> running requests holding it
        self.queries = 0
        self.hits = 0
        self.events: list[KVEvent] = []

    # ------------------------------------------------------------------ state

    @property
    def free(self) -> int:
        return self._uncached_free + len(self._cached_free)

    @property
    def cached(self) -> int:
        """Blocks whose hash is in the prefix cache (in use or free)."""
        return len(self._refs)

    def usage(self) -> float:
        """``vllm:kv_cache_usage_perc``: the share of usable blocks held by running requests."""
        return 1.0 - self.free / self.usable

    def is_cached(self, h: bytes) -> bool:
        return h in self._refs

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # ------------------------------------------------------------------ requests

    def admit(self, token_ids: Sequence[int], max_new_tokens: int = 0) -> Allocation | None:
        """Admit a request whose prompt is ``token_ids`` and which may generate ``max_new_tokens``.

        Returns None, changing nothing, when too few blocks are free (the request waits); a
        sequence longer than the whole cache is held to the whole cache. Counts the prefix-cache
        query and hit, stores the prompt's newly full blocks (one ``BlockStored``) and evicts
        what their memory displaces (a ``BlockRemoved`` each, before it).
        """
        bs = self.block_size
        hashes = block_hashes(token_ids, bs, self.root) if self.enable_caching else []
        hit = 0
        limit = min(max(len(token_ids) - 1, 0) // bs, len(hashes))
        while hit < limit and hashes[hit] in self._refs:
            hit += 1
        hit_free = sum(1 for h in hashes[:hit] if self._refs[h] == 0)
        # the last generated token is sampled, never computed: it takes no KV
        total = min(self.blocks_for(len(token_ids) + max(max_new_tokens - 1, 0)), self.usable)
        total = max(total, hit)
        need = total - hit
        if need + hit_free > self.free:
            return None
        self.queries += len(token_ids) if self.enable_caching else 0
        self.hits += hit * bs
        for h in hashes[:hit]:  # touch: a free cached block leaves the free queue
            if self._refs[h] == 0:
                del self._cached_free[h]
            self._refs[h] += 1
        self._take(need)
        kept = hashes[:hit]
        stored = []
        for h in hashes[hit:total]:
            if h in self._refs:  # a duplicate of a cached block: computed again, left unhashed
                break
            self._refs[h] = 1
            kept.append(h)
            stored.append(h)
        if stored and self.record_events:
            start = hit * bs
            self.events.append(self._stored(stored, kept[hit - 1] if hit else None,
                                            token_ids[start:start + len(stored) * bs]))
        return Allocation(list(token_ids), kept, total, hit * bs, stored,
                          chain_open=self.enable_caching and len(kept) == len(hashes))

    def release(self, alloc: Allocation, generated: Sequence[int] = ()) -> None:
        """The request finished (or was aborted) after generating ``generated``: store the blocks
        its generated tokens filled, then free its blocks tail first."""
        if alloc.chain_open and generated:
            self._store_generated(alloc, generated)
        cached = alloc.hashes
        unhashed = alloc.blocks - len(cached)
        self._uncached_free += unhashed  # prepended: reused first (vLLM: LIFO for these)
        for h in reversed(cached):  # appended tail first: a chain's tail is evicted before its head
            self._refs[h] -= 1
            if self._refs[h] == 0:
                self._cached_free[h] = None
        alloc.blocks = 0
        alloc.hashes = []

    def _store_generated(self, alloc: Allocation, generated: Sequence[int]) -> None:
        """One ``BlockStored`` per block, as vLLM publishes them: decoding fills one block at a time."""
        bs = self.block_size
        seq = alloc.token_ids + list(generated)
        held = min(alloc.blocks, (len(seq) - 1) // bs)  # the last token sampled has no KV
        parent = alloc.hashes[-1] if alloc.hashes else None
        for i in range(len(alloc.hashes) * bs, held * bs, bs):
            h = hash_block(parent, seq[i:i + bs], self.root)
            if h in self._refs:
                break
            self._refs[h] = 1
            alloc.hashes.append(h)
            if self.record_events:
                self.events.append(self._stored([h], parent, seq[i:i + bs]))
            parent = h

    def reset(self) -> bool:
        """``/reset_prefix_cache``: forget every cached hash; refused (False) while blocks are in use."""
        if self.free != self.usable:
            return False
        self._refs.clear()
        self._cached_free.clear()
        self._uncached_free = self.usable
        if self.record_events:
            self.events.append(AllBlocksCleared())
        return True

    def drain(self) -> list[KVEvent]:
        """The events recorded since the last drain (one engine step's batch)."""
        out, self.events = self.events, []
        return out

    # ------------------------------------------------------------------ internals

    def _take(self, n: int) -> None:
        """Allocate ``n`` free blocks: unhashed ones first, then evict cached ones, LRU first."""
        fresh = min(n, self._uncached_free)
        self._uncached_free -= fresh
        for _ in range(n - fresh):
            h, _ = self._cached_free.popitem(last=False)
            del self._refs[h]
            if self.record_events:
                self.events.append(BlockRemoved(block_hashes=(external(h),), medium=MEDIUM, group_idx=0))

    def _stored(self, hashes: list[bytes], parent: bytes | None, tokens: Sequence[int]) -> BlockStored:
        return BlockStored(
            block_hashes=tuple(external(h) for h in hashes),
            parent_block_hash=None if parent is None else external(parent),
            token_ids=tuple(tokens), block_size=self.block_size, lora_id=None, medium=MEDIUM, lora_name=None,
            extra_keys=(None,) * len(hashes), group_idx=0, kv_cache_spec_kind=SPEC_KIND,
        )
