"""When a disaggregated model's request is prefilled remotely: the prompt less what the chosen decoder
caches, against ``disaggregation.min_uncached_tokens`` (llm-d's prefix-based rule), and its counting."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from llmgw.config import ConfigInvalid
from llmgw.kvroutekeys import chain_keys, to_hex
from llmgw.router.balancing import ByModel, CacheAware, LeastOutstanding, PrefixAffinity
from llmgw.router.context import RequestContext
from llmgw.router.endpoints import Endpoint, EndpointTable
from llmgw.router.kvindex import KVIndex
from llmgw.router.kvindex_tokens import simulator_token_ids
from llmgw.router.metrics import RouterMetrics
from llmgw.router.prefill import (CACHED, NO_PREFILL_ENDPOINT, REMOTE, SHORT, Prefill, decide,
                                  estimate_tokens)
from llmgw.router.runtime import Routing
from llmgw.router.settings import RouterSettings
from llmgw.sim.sim_kvcache import token_ids
from tests.support.ports import free_port

BS = 16
TURN1 = [f"w{i}" for i in range(40 * BS)]  # 640 tokens: over the default 512
TURN2 = TURN1 + [f"x{i}" for i in range(5 * BS)]  # the same conversation, 80 tokens more


@pytest.mark.parametrize("prompt, cached, threshold, available, want", [
    (640, 0, 512, True, REMOTE),  # a new long prompt
    (720, 640, 512, True, CACHED),  # its second turn: 80 tokens left to compute on the decoder
    (720, 160, 512, True, REMOTE),  # a short run cached leaves enough to be worth the transfer
    (300, 0, 512, True, SHORT),
    (300, 160, 512, True, SHORT),  # short on its own: cached or not makes no difference
    (720, 208, 512, True, REMOTE),  # exactly the threshold uncached: remote
    (640, 0, 512, False, NO_PREFILL_ENDPOINT),
    (720, 640, 512, False, CACHED),  # not wanted anyway: the reason is the cache, not the prefill group
    (10, 10, 0, True, REMOTE),  # 0: every prompt past min_prompt_bytes
    (100, 500, 50, True, CACHED),  # more cached than counted (a capped count): all of it
])
def test_the_rule(prompt, cached, threshold, available, want):
    d = decide(prompt, cached, threshold, available)
    assert d.reason == want and d.remote == (want == REMOTE)
    assert d.cached_tokens == min(cached, prompt)


def test_prompt_length_without_token_ids_is_four_characters_a_token():
    assert estimate_tokens({"prompt": "a" * 4000}, 5000) == 1000
    assert estimate_tokens({"prompt": [1, 2, 3]}, 100) == 3  # token ids count as themselves
    chat = {"messages": [{"role": "user", "content": "b" * 394}]}
    assert estimate_tokens(chat, 1000) == 100  # "user", a separator either side of the text


def routed(held_blocks: int, scorer_kind: str = "cache-aware", prefill_url: str | None = None,
           **disagg) -> tuple[Prefill, Routing, RouterMetrics]:
    """A decoder whose engine holds the first ``held_blocks`` blocks of TURN1 (by its route keys),
    a prefill endpoint that refuses connections, and the router's prefill phase over them."""
    eps = [Endpoint.from_dict({"id": "d", "replica_id": "dec-0", "model": "m", "url": "http://127.0.0.1:1",
                               "role": "decode"}),
           Endpoint.from_dict({"id": "p", "model": "m", "url": prefill_url or f"http://127.0.0.1:{free_port()}",
                               "role": "prefill"})]
    index = KVIndex()
    keys = chain_keys(token_ids(TURN1), BS)[:held_blocks]
    index.apply({"epoch": "e", "revision": 1, "full": True,
                 "replicas": [{"replica_id": "dec-0", "added": [to_hex(k) for k in keys]}]}, time.monotonic())
    cache_aware = CacheAware(index, simulator_token_ids, BS, 8192, PrefixAffinity(256, 1.25, random.Random(1)))
    scorer = ByModel(LeastOutstanding(), {"m": cache_aware} if scorer_kind == "cache-aware" else {})
    settings = RouterSettings.from_config({"disaggregation": {"min_prompt_bytes": 0, **disagg},
                                         "allow_unauthenticated": True, "insecure_http": True})
    metrics = RouterMetrics()
    routing = Routing(EndpointTable(eps), settings, metrics, scorer)
    return Prefill(settings, routing, metrics), routing, metrics


def decision(prefill: Prefill, words: list[str], **payload) -> tuple[str | None, bytes, str]:
    routing = prefill.routing
    group = routing.group("m")
    body = {"model": "m", "prompt": " ".join(words), "max_tokens": 4, **payload}
    raw = repr(body).encode()

    async def run():
        return await prefill.before_decode(RequestContext("r", 0.0), group, b"/v1/completions", raw, body, body,
                                           b"", asyncio.get_running_loop().time() + 10)

    decoder, sent = asyncio.run(run())
    counts = {d: prefill.metrics.prefill_decisions.labels("m", d)._value.get()
              for d in (REMOTE, SHORT, CACHED, NO_PREFILL_ENDPOINT)}
    (reason,) = [d for d, n in counts.items() if n]
    return (decoder.id if decoder is not None else None), sent, reason


def test_a_conversation_the_decoder_holds_is_not_prefilled_remotely():
    """Fails before the rule: the second turn's body is as long as the first's, so it went remote."""
    prefill, _, metrics = routed(held_blocks=40)
    decoder, sent, reason = decision(prefill, TURN2)
    assert (decoder, reason) == ("d", CACHED)
    assert b"kv_transfer_params" not in sent
    assert metrics.prefill.labels("m", "fallback")._value.get() == 0  # no prefill endpoint was asked


def test_a_new_long_prompt_is_prefilled_remotely_for_the_chosen_decoder():
    prefill, _, metrics = routed(held_blocks=2)  # 32 tokens of it cached: 688 left
    decoder, sent, reason = decision(prefill, TURN2)
    assert (decoder, reason) == ("d", REMOTE)
    # the prefill endpoint refused: the decoder gets the request as it came, and prefills it itself
    assert metrics.prefill.labels("m", "fallback")._value.get() == 1
    assert b"kv_transfer_params" not in sent
    assert prefill.routing.group("m").members[0].outstanding == 0  # held during the prefill, released


def test_without_the_index_nothing_counts_as_cached():
    """A model the index does not cover: prompt length alone (estimated), as llm-d without prefix data."""
    prefill, _, _ = routed(held_blocks=40, scorer_kind="plain")
    assert decision(prefill, TURN2)[2] == REMOTE
    prefill, _, _ = routed(held_blocks=40, scorer_kind="plain")
    assert decision(prefill, TURN1[:100])[2] == SHORT  # 100 words of "wNNN": about 125 estimated tokens


def test_a_stale_feed_counts_as_nothing_cached():
    prefill, routing, _ = routed(held_blocks=40)
    cache_aware = routing.scorer.scorers["m"]
    cache_aware.clock = lambda: time.monotonic() + 10_000  # the watch silent far past stale_after
    assert decision(prefill, TURN2)[2] == REMOTE


def test_no_usable_prefill_endpoint_is_its_own_reason():
    prefill, routing, _ = routed(held_blocks=0)
    for rt in routing.group("m").prefill.members:
        rt.health.ejected_until = time.monotonic() + 60
    decoder, sent, reason = decision(prefill, TURN2)
    assert (decoder, reason) == ("d", NO_PREFILL_ENDPOINT)


def test_the_body_gate_comes_first():
    prefill, _, _ = routed(held_blocks=0, min_prompt_bytes=1 << 20)
    assert decision(prefill, TURN2)[:1] == (None,)  # no decoder chosen ahead: the forwarder picks as ever
    assert prefill.metrics.prefill_decisions.labels("m", SHORT)._value.get() == 1


def test_the_threshold_is_validated_with_its_pointer():
    with pytest.raises(ConfigInvalid) as e:
        RouterSettings.from_config({"disaggregation": {"min_uncached_tokens": -1},
                                  "allow_unauthenticated": True, "insecure_http": True})
    assert "/disaggregation/min_uncached_tokens" in str(e.value)
    assert RouterSettings().disaggregation.min_uncached_tokens == 512
