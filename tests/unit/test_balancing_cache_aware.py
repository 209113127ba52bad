"""The cache-aware scorer: longest held prefix under the load bound, prefix affinity where the index
cannot speak, chosen per model; and its settings."""

from __future__ import annotations

import random

import pytest

from llmgw.config import ConfigInvalid
from llmgw.kvroutekeys import chain_keys, to_hex
from llmgw.router.balancing import ByModel, CacheAware, LeastOutstanding, PrefixAffinity, make_balancer
from llmgw.router.kvindex import KVIndex
from llmgw.router.kvindex_tokens import simulator_token_ids
from llmgw.router.settings import RouterSettings
from llmgw.sim.sim_kvcache import token_ids
from tests.support.scorermembers import Ep, Member

BS = 4


def members(n: int, model: str = "m") -> list[Member]:
    return [Member(f"e{i}", Ep(model, f"r{i}")) for i in range(n)]


PROMPT = " ".join(f"w{i}" for i in range(3 * BS + 2))
KEYS = chain_keys(token_ids(PROMPT.split()), BS)


def indexed(held: dict[str, int], now: float = 0.0) -> KVIndex:
    """An index where replica r holds the first ``held[r]`` blocks of PROMPT."""
    index = KVIndex(stale_after=10)
    index.apply({"epoch": "e", "revision": 1, "full": True, "replicas": [
        {"replica_id": r, "reset": True, "added": [to_hex(k) for k in KEYS[:n]]} for r, n in held.items()]}, now)
    return index


def scorer(index: KVIndex, now: list[float]) -> CacheAware:
    return CacheAware(index, simulator_token_ids, BS, 1000, PrefixAffinity(256, 1.25, random.Random(1)),
                      clock=lambda: now[0])


def test_the_longest_held_prefix_wins_under_the_load_bound():
    ms = members(3)
    now = [1.0]
    s = scorer(indexed({"r0": 1, "r1": 3, "r2": 0}), now)
    body = {"prompt": PROMPT}
    assert s.pick(ms, lambda m: True, body) is ms[1] and s.precise == 1
    ms[1].outstanding = 5  # a hot replica is not buried: past the bound the next best takes it
    assert s.pick(ms, lambda m: True, body) is ms[0]
    assert s.pick(ms, lambda m: m is not ms[0] and m is not ms[1], body) is ms[2]  # only r2: fallback
    assert s.fell_back == 1


def test_prefix_affinity_where_the_index_cannot_speak():
    ms = members(3)
    now = [1.0]
    s = scorer(indexed({"r0": 3}), now)
    affinity = PrefixAffinity(256, 1.25, random.Random(1))
    body = {"prompt": PROMPT}
    assert s.pick(ms, lambda m: True, body) is ms[0]
    now[0] = 20.0  # the watch silent past stale_after: the index may be wrong about evictions
    assert s.pick(ms, lambda m: True, body) is affinity.pick(ms, lambda m: True, body) and s.fell_back == 1
    now[0] = 1.0
    assert s.pick(ms, lambda m: True, {"prompt": "short"}) is affinity.pick(ms, lambda m: True, {"prompt": "short"})
    none = scorer(KVIndex(), now)  # engines that publish nothing: no entry at all
    assert none.pick(ms, lambda m: True, body) is affinity.pick(ms, lambda m: True, body)
    assert none.precise == 0


def test_the_simulators_tokens_for_chat_and_completions():
    assert simulator_token_ids({"prompt": "a b c"}, 2) == token_ids(["a", "b"])
    assert simulator_token_ids({"prompt": [5, 6]}, 10) == [5, 6]
    assert simulator_token_ids({"messages": [{"role": "user", "content": "hi there"}]}, 10) == \
        token_ids(["user:", "hi", "there"])
    assert simulator_token_ids({"prompt": 3}, 10) == [] and simulator_token_ids(None, 10) == []


def test_by_model_and_the_settings():
    default = LeastOutstanding(random.Random(1))
    picked = []

    class Marker:
        def pick(self, ms, eligible, payload):
            picked.append(ms[0].endpoint.model)
            return ms[0]

    b = ByModel(default, {"sim": Marker()})
    b.pick(members(2, "sim"), lambda m: True, None)
    b.pick(members(2, "other"), lambda m: True, None)
    assert picked == ["sim"]
    base = {"listen": {"port": 1}, "allow_unauthenticated": True, "insecure_http": True}
    s = RouterSettings.from_config(base)
    assert s.balancing.cache_aware.models == () and make_balancer(s.balancing, KVIndex()).name == "least-outstanding"
    cp = {"url": "https://cp:1", "ca": "/ca", "cert": "/c", "key": "/k"}
    s = RouterSettings.from_config({**base, "control_plane": cp,
                                    "balancing": {"cache_aware": {"models": ["sim"], "block_size": 32}}})
    assert s.balancing.cache_aware.block_size == 32 and isinstance(make_balancer(s.balancing, KVIndex()), ByModel)
    with pytest.raises(ConfigInvalid, match="/balancing/cache_aware/models"):
        RouterSettings.from_config({**base, "balancing": {"cache_aware": {"models": ["sim"]}}})
    with pytest.raises(ConfigInvalid, match="tokenizer"):
        RouterSettings.from_config({**base, "control_plane": cp,
                                    "balancing": {"cache_aware": {"models": ["sim"], "tokenizer": "hf"}}})


def test_the_pick_predicts_the_tokens_its_replica_reports_cached():
    """What the index predicts is what vLLM reuses: the held leading blocks, but never the prompt's
    last token (computed again for its logits), and nothing for a pick by prefix affinity."""
    ms = members(3)
    now = [1.0]
    s = scorer(indexed({"r0": 1, "r1": 3}), now)
    assert s.pick(ms, lambda m: True, {"prompt": PROMPT}) is ms[1] and s.predicted == 3 * BS
    by = ByModel(LeastOutstanding(random.Random(1)), {"m": s})
    assert by.predicted(ms) == 3 * BS and by.predicted(members(1, "other")) is None
    whole = " ".join(PROMPT.split()[:3 * BS])  # exactly the three held blocks: the last one is computed again
    assert s.pick(ms, lambda m: True, {"prompt": whole}) is ms[1] and s.predicted == 2 * BS
    s.pick(ms, lambda m: m is ms[2], {"prompt": PROMPT})  # only r2, which holds nothing: prefix affinity
    assert s.predicted is None and by.predicted(ms) is None


def test_predicted_cached_caps_only_a_whole_prompt():
    from llmgw.router.balancing import predicted_cached

    assert predicted_cached(3, 14, 4, 1000) == 12
    assert predicted_cached(3, 12, 4, 1000) == 8  # all 12 tokens held: the last block is recomputed
    assert predicted_cached(3, 12, 4, 12) == 12  # keyed up to max_tokens: the prompt is longer
    assert predicted_cached(0, 0, 4, 1000) == 0
