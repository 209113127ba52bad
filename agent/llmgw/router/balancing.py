"""Choosing an endpoint among the eligible ones: pure, pluggable scorers.

- ``LeastOutstanding``: power of two random choices on in-flight requests.
  Sampling two avoids the herd that "globally least loaded" causes when
  several router processes share stale-identical views.
- ``PrefixAffinity``: requests whose prompts start alike (shared system
  prompt, same conversation) go to the same endpoint, so its prefix cache
  hits.  Consistent hashing keeps the mapping stable as endpoints come and
  go; the load bound (Mirrokni et al., "Consistent Hashing with Bounded
  Loads") moves a request along the ring when its home endpoint already
  carries more than ``load_bound`` times the mean, so a hot prefix cannot
  melt one replica.
- ``CacheAware``: the replica whose engine holds the longest run of the
  request's leading KV blocks, as its route keys say (``kvindex``, fed by
  the control plane's watch), under the same load bound.  Where the index
  cannot speak (a replica's feed stale or absent, no replica holding any
  block, a prompt it cannot tokenize) it is ``PrefixAffinity``, so the
  first request of a prefix lands where the next ones will look.  A model
  with its own tokenizer is tokenized before the pick, off the event loop
  (``prepare``, awaited by the forwarder); the pick itself never tokenizes.
- ``ByModel``: a scorer per model (``balancing.cache_aware.models``), the
  default for the rest.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Protocol, Sequence, TypeVar

from llmgw.kvroutekeys import chain_keys

if TYPE_CHECKING:
    from .kvindex import KVIndex
    from .tokenize_pool import TokenizePool
    from .settings import Balancing


class Loaded(Protocol):
    id: str

    @property
    def outstanding(self) -> int: ...


T = TypeVar("T", bound=Loaded)

# A scorer gets the model's endpoints in a stable order (the ring is built on
# it), a predicate saying which may take a request now, and the parsed body.
Eligible = Callable[[Any], bool]


def _h64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def power_of_two(cands: Sequence[T], rng: random.Random) -> T:
    """Pick the less loaded of two distinct random candidates."""
    n = len(cands)
    if n == 1:
        return cands[0]
    i = rng.randrange(n)
    j = rng.randrange(n - 1)
    if j >= i:
        j += 1
    a, b = cands[i], cands[j]
    return a if a.outstanding <= b.outstanding else b


class LeastOutstanding:
    name = "least-outstanding"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(self, members: Sequence[T], eligible: Eligible, payload: dict[str, Any] | None) -> T | None:
        cands = [m for m in members if eligible(m)]
        if not cands:
            return None
        return power_of_two(cands, self._rng)


class HashRing:
    """Consistent-hash ring over member indices, ``vnodes`` points each."""

    def __init__(self, ids: Sequence[str], vnodes: int = 64) -> None:
        points = sorted(
            (_h64(f"{ident}#{v}".encode()), idx) for idx, ident in enumerate(ids) for v in range(vnodes)
        )
        self._hashes = [p[0] for p in points]
        self._owners = [p[1] for p in points]
        self.size = len(ids)

    def walk(self, key_hash: int) -> Iterator[int]:
        """Distinct member indices in ring order starting at ``key_hash``."""
        if not self._hashes:
            return
        start = bisect.bisect_left(self._hashes, key_hash)
        seen: set[int] = set()
        n = len(self._hashes)
        for k in range(n):
            owner = self._owners[(start + k) % n]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == self.size:
                    return


def prefix_text(payload: dict[str, Any] | None, n_chars: int) -> str:
    """The first ``n_chars`` characters of what the engine will tokenize first.

    Chat: messages in order (role and text parts); completions: the prompt;
    embeddings: the input.  Token-id prompts use their decimal form.  Empty
    when the body carries nothing usable.
    """
    if not payload:
        return ""
    out: list[str] = []
    size = 0

    def add(s: str) -> bool:
        nonlocal size
        out.append(s)
        size += len(s)
        return size >= n_chars

    msgs = payload.get("messages")
    if isinstance(msgs, list):
        for m in msgs:
            if not isinstance(m, dict):
                continue
            if add(f"{m.get('role', '')}\x00"):
                break
            content = m.get("content")
            if isinstance(content, str):
                if add(content):
                    break
            elif isinstance(content, list):
                stop = False
                for part in content:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        if add(part["text"]):
                            stop = True
                            break
                if stop:
                    break
            if add("\x01"):
                break
    else:
        prompt = payload.get("prompt", payload.get("input"))
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch: the first prompt decides
        if isinstance(prompt, str):
            add(prompt)
        elif isinstance(prompt, list):
            add(",".join(str(t) for t in prompt[: n_chars // 2]))
    return "".join(out)[:n_chars]


class PrefixAffinity:
    name = "prefix-affinity"

    def __init__(self, prefix_tokens: int, load_bound: float, rng: random.Random | None = None) -> None:
        self.n_chars = prefix_tokens * 4  # ~4 characters per token for BPE vocabularies
        self.load_bound = load_bound
        self._fallback = LeastOutstanding(rng)
        self._rings: dict[tuple[str, ...], HashRing] = {}

    def ring(self, members: Sequence[Loaded]) -> HashRing:
        ids = tuple(m.id for m in members)
        r = self._rings.get(ids)
        if r is None:
            if len(self._rings) > 256:  # membership changes; do not keep every old ring
                self._rings.clear()
            r = self._rings[ids] = HashRing(ids)
        return r

    def pick(self, members: Sequence[T], eligible: Eligible, payload: dict[str, Any] | None) -> T | None:
        text = prefix_text(payload, self.n_chars)
        if not text:
            return self._fallback.pick(members, eligible, payload)
        cands = [m for m in members if eligible(m)]
        if not cands:
            return None
        cap = load_cap(cands, self.load_bound)
        ok = {id(m) for m in cands}
        for idx in self.ring(members).walk(_h64(text.encode("utf-8", "surrogatepass"))):
            m = members[idx]
            if id(m) in ok and m.outstanding + 1 <= cap:
                return m
        return power_of_two(cands, self._fallback._rng)  # unreachable by the bound's arithmetic


def _replica_id(m: Any) -> str:
    ep = getattr(m, "endpoint", None)
    return (getattr(ep, "replica_id", "") or m.id) if ep is not None else m.id


class Tokenized(dict):
    """A request's payload with the token ids its model's tokenizer made of it, off the event loop
    (``CacheAware.prepare``); ``token_ids`` None: the router could not say in time, or at all."""

    __slots__ = ("token_ids",)

    def __init__(self, payload: dict[str, Any], token_ids: list[int] | None) -> None:
        super().__init__(payload)
        self.token_ids = token_ids


class CacheAware:
    name = "cache-aware"

    def __init__(self, index: "KVIndex", tokenize: Callable[[dict[str, Any] | None, int], list[int]] | None,
                 block_size: int, max_tokens: int, fallback: PrefixAffinity,
                 clock: Callable[[], float] = time.monotonic, model_tokenizer: Any = None,
                 pool: "TokenizePool | None" = None, on_fallback: Callable[[str], None] | None = None) -> None:
        self.index = index
        self.tokenize = tokenize  # inline and cheap (the simulator's); None: ``model_tokenizer`` in ``pool``
        self.block_size = block_size
        self.max_tokens = max_tokens
        self.fallback = fallback
        self.clock = clock
        self.model_tokenizer = model_tokenizer
        self.pool = pool
        self.on_fallback = on_fallback or (lambda reason: None)
        self.enabled = True  # False: the parity check found the router's ids differ from the engine's
        self.disabled_reason: str | None = None
        self.precise = 0  # requests placed by the index
        self.fell_back = 0  # requests placed by prefix affinity
        # the prompt tokens the last pick expects its replica to find cached (None: placed by prefix
        # affinity); read by the forwarder right after ``pick``, before anything else can run
        self.predicted: int | None = None

    def disable(self, reason: str) -> None:
        self.enabled, self.disabled_reason = False, reason

    async def prepare(self, members: Sequence[Any], payload: dict[str, Any] | None) -> dict[str, Any] | None:
        """``payload`` with its token ids, tokenized in the pool under its deadline; as is when ids
        would not be used (inline tokenizer, precise routing off, no replica's feed fresh)."""
        if self.tokenize is not None or self.pool is None or not payload or not self.enabled:
            return payload
        now = self.clock()
        if not any(self.index.fresh(_replica_id(m), now) for m in members):
            return payload
        ids, why = await self.pool.run(self._token_ids, payload)
        if why is not None:
            self.on_fallback(why)
        return Tokenized(payload, ids)

    def _token_ids(self, payload: dict[str, Any]) -> list[int] | None:
        from .tokenize_model import Unrenderable

        try:
            return self.model_tokenizer.token_ids(payload, self.max_tokens)
        except Unrenderable:
            return None

    def held_tokens(self, m: Any, payload: dict[str, Any] | None) -> tuple[int, int] | None:
        """The request's token ids counted (at most ``max_tokens``) and the tokens of the longest
        leading run of its blocks that ``m``'s engine holds, as the index says; None when it cannot
        say (``m``'s feed stale or absent, no token ids). For the remote-prefill rule (``prefill``)."""
        if not self.index.fresh(_replica_id(m), self.clock()):
            return None
        ids = self._ids(payload)
        if not ids:
            return None
        return len(ids), self.index.held_prefix(_replica_id(m), chain_keys(ids, self.block_size)) * self.block_size

    def holdings(self, payload: dict[str, Any] | None) -> Callable[[Any], int | None]:
        """For one request: how many of its leading tokens a member's engine holds, in whole blocks
        (None where the index cannot say: a stale or absent feed, no token ids). The prompt is keyed
        once, at the first member asked about. For the choice of a prefill endpoint (``prefill``)."""
        keys: list[int] | None = None

        def held(m: Any) -> int | None:
            nonlocal keys
            if not self.index.fresh(_replica_id(m), self.clock()):
                return None
            if keys is None:
                keys = chain_keys(self._ids(payload), self.block_size)
            if not keys:
                return None
            return self.index.held_prefix(_replica_id(m), keys) * self.block_size
        return held

    def _ids(self, payload: dict[str, Any] | None) -> list[int]:
        if not self.enabled:
            return []
        if self.tokenize is not None:
            return self.tokenize(payload, self.max_tokens)
        return (getattr(payload, "token_ids", None) or []) if isinstance(payload, Tokenized) else []

    def pick(self, members: Sequence[T], eligible: Eligible, payload: dict[str, Any] | None) -> T | None:
        cands = [m for m in members if eligible(m)]
        if not cands:
            return None
        now = self.clock()
        fresh = [m for m in cands if self.index.fresh(_replica_id(m), now)]
        best: T | None = None
        held_best = 0
        ids: list[int] = []
        if fresh:
            ids = self._ids(payload)
            keys = chain_keys(ids, self.block_size)
            if keys:
                best, held_best = best_holder(cands, lambda m: self.index.held_prefix(_replica_id(m), keys),
                                              self.fallback.load_bound, fresh)
        if best is None:
            self.fell_back += 1
            self.predicted = None
            return self.fallback.pick(members, eligible, payload)
        self.precise += 1
        self.predicted = predicted_cached(held_best, len(ids), self.block_size, self.max_tokens)
        return best


def load_cap(cands: Sequence[Any], load_bound: float) -> int:
    """The most requests in flight a member of ``cands`` may carry with one more added: ``load_bound``
    times the mean over ``cands``, rounded up, so an affinity (a prefix, a cached block) cannot bury one."""
    return math.ceil(load_bound * (sum(m.outstanding for m in cands) + 1) / len(cands))


def best_holder(cands: Sequence[T], held: Callable[[T], int | None], load_bound: float,
                among: Sequence[T] | None = None) -> tuple[T | None, int]:
    """The member of ``among`` (default ``cands``) for which ``held`` is largest, ties to the least
    loaded, leaving out any that would carry more than ``load_bound`` times the mean load of
    ``cands`` with one more request (so a hot prefix cannot bury one endpoint); and what it holds.
    (None, 0) when none within the bound holds anything. The decoders' cache-aware pick and the
    prefill phase's (``runtime.choose_prefill``) both choose by it."""
    cap = load_cap(cands, load_bound)
    best: T | None = None
    held_best = 0
    for m in (cands if among is None else among):
        if m.outstanding + 1 > cap:
            continue
        h = held(m) or 0
        if h > held_best or (h and h == held_best and m.outstanding < best.outstanding):  # type: ignore[union-attr]
            best, held_best = m, h
    return best, held_best


def predicted_cached(held_blocks: int, ids: int, block_size: int, max_tokens: int) -> int:
    """The prompt tokens an engine holding ``held_blocks`` leading blocks reports cached.

    vLLM computes a prompt's last token again (it needs its logits), so a prompt found whole in
    the cache reuses at most ``ids - 1`` tokens, in whole blocks. ``ids`` is the whole prompt only
    below ``max_tokens`` (the router keys only the first ``max_tokens``); past it the prompt is
    longer and the cap cannot bind."""
    tokens = held_blocks * block_size
    if ids < max_tokens:
        tokens = min(tokens, (ids - 1) // block_size * block_size)
    return max(tokens, 0)


class ByModel:
    """The scorer of the members' model, else the default (every member of a group shares a model)."""

    name = "by-model"

    def __init__(self, default: Any, scorers: Mapping[str, Any]) -> None:
        self.default = default
        self.scorers = dict(scorers)

    def pick(self, members: Sequence[T], eligible: Eligible, payload: dict[str, Any] | None) -> T | None:
        ep = getattr(members[0], "endpoint", None) if members else None
        scorer = self.scorers.get(getattr(ep, "model", None), self.default) if ep is not None else self.default
        return scorer.pick(members, eligible, payload)

    def predicted(self, members: Sequence[Any]) -> int | None:
        """What the last pick among ``members`` predicted cached (``CacheAware.predicted``); None when
        their model is not routed by the index or the pick fell back."""
        ep = getattr(members[0], "endpoint", None) if members else None
        scorer = self.scorers.get(getattr(ep, "model", None)) if ep is not None else None
        return scorer.predicted if isinstance(scorer, CacheAware) else None

    async def prepare(self, members: Sequence[Any], payload: dict[str, Any] | None) -> dict[str, Any] | None:
        ep = getattr(members[0], "endpoint", None) if members else None
        scorer = self.scorers.get(getattr(ep, "model", None)) if ep is not None else None
        prepare = getattr(scorer, "prepare", None)
        return await prepare(members, payload) if prepare is not None else payload


def make_balancer(b: "Balancing", index: "KVIndex | None", registry: Any = None) -> Any:
    """The scorer ``balancing`` asks for: ``make_scorer``'s, with ``cache_aware.models`` routed by ``index``.

    A model with a tokenizer directory (``cache_aware.model_tokenizers``) is tokenized with its own
    tokenizer in a shared thread pool; the others with the engine simulator's, inline."""
    default = make_scorer(b.scorer, b.prefix_tokens, b.load_bound)
    ca = b.cache_aware
    if not ca.models or index is None:
        return default
    from .kvindex_tokens import simulator_token_ids

    scorers: dict[str, Any] = {}
    shared = CacheAware(index, simulator_token_ids, ca.block_size, ca.max_prompt_tokens,
                        PrefixAffinity(b.prefix_tokens, b.load_bound))
    if ca.model_tokenizers:
        from .kvindex_tokens import model_scorers

        scorers.update(model_scorers(ca, index, PrefixAffinity(b.prefix_tokens, b.load_bound), registry))
    return ByModel(default, {m: scorers.get(m, shared) for m in ca.models})


def make_parity_check(scorer: Any, timeout: float, registry: Any = None) -> Any:
    """The parity check of the models ``scorer`` tokenizes with their own tokenizer; None if none."""
    own = {m: s for m, s in getattr(scorer, "scorers", {}).items()
           if isinstance(s, CacheAware) and s.model_tokenizer is not None}
    if not own:
        return None
    from .tokenize_parity import ParityCheck

    return ParityCheck(own, timeout, registry)


def make_scorer(name: str, prefix_tokens: int, load_bound: float) -> LeastOutstanding | PrefixAffinity:
    if name == "least-outstanding":
        return LeastOutstanding()
    if name == "prefix-affinity":
        return PrefixAffinity(prefix_tokens, load_bound)
    raise ValueError(f"unknown scorer {name!r}")
