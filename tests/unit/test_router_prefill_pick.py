"""Which prefill endpoint computes a prompt: the one whose engine holds the most of it, within the
load bound, else the least loaded (``runtime.choose_prefill``, fed by the route-key index)."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

from llmgw.kvroutekeys import chain_keys, to_hex
from llmgw.router.balancing import ByModel, CacheAware, LeastOutstanding, PrefixAffinity
from llmgw.router.context import RequestContext
from llmgw.router.endpoints import Endpoint, EndpointTable
from llmgw.router.kvindex import KVIndex
from llmgw.router.kvindex_tokens import simulator_token_ids
from llmgw.router.metrics import RouterMetrics
from llmgw.router.prefill import Prefill
from llmgw.router.runtime import Routing, choose_prefill
from llmgw.router.settings import RouterSettings
from llmgw.sim.sim_kvcache import token_ids
from tests.support.ports import free_port

BS = 16
PROMPT = [f"w{i}" for i in range(40 * BS)]  # 640 tokens: remote under the default 512


@dataclass
class M:
    id: str
    outstanding: int


def test_the_holder_of_the_most_is_chosen_unless_it_is_past_the_load_bound():
    a, b, c = M("a", 1), M("b", 2), M("c", 1)
    held = {"a": 0, "b": 320, "c": 160}
    assert choose_prefill([a, b, c], (lambda m: held[m.id], 1.25)).id == "b"  # 1.25 x (4 + 1) / 3: 3 at most
    a.outstanding, b.outstanding, c.outstanding = 0, 3, 0  # 1.25 x (3 + 1) / 3: 2 at most, b would carry 4
    assert choose_prefill([a, b, c], (lambda m: held[m.id], 1.25)).id == "c"
    held["c"] = 320
    a.outstanding, b.outstanding, c.outstanding = 1, 1, 0
    assert choose_prefill([a, b, c], (lambda m: held[m.id], 1.25)).id == "c"  # a tie goes to the less loaded


def test_without_a_holder_or_an_index_the_least_loaded():
    a, b = M("a", 2), M("b", 1)
    assert choose_prefill([a, b], (lambda m: 0, 1.25)).id == "b"
    assert choose_prefill([a, b], (lambda m: None, 1.25)).id == "b"  # stale feeds say nothing
    assert choose_prefill([a, b], None).id == "b"
    assert choose_prefill([], None) is None


def phase(holder: str | None) -> tuple[Prefill, RouterMetrics, list[str]]:
    """A decoder and two prefill endpoints that refuse connections; the index says ``holder``'s engine
    holds the prompt's first 30 blocks. Returns the prefill phase and the order endpoints failed in."""
    eps = [Endpoint.from_dict({"id": "d", "replica_id": "dec-0", "model": "m", "url": "http://127.0.0.1:1",
                               "role": "decode"})]
    eps += [Endpoint.from_dict({"id": p, "replica_id": f"pre-{p}", "model": "m",
                                "url": f"http://127.0.0.1:{free_port()}", "role": "prefill"}) for p in ("p1", "p2")]
    index = KVIndex()
    keys = chain_keys(token_ids(PROMPT), BS)[:30]
    reps = [{"replica_id": f"pre-{p}", "added": [to_hex(k) for k in keys] if p == holder else []}
            for p in ("p1", "p2")]
    index.apply({"epoch": "e", "revision": 1, "full": True, "replicas": reps}, time.monotonic())
    scorer = ByModel(LeastOutstanding(), {"m": CacheAware(index, simulator_token_ids, BS, 8192,
                                                          PrefixAffinity(256, 1.25, random.Random(1)))})
    settings = RouterSettings.from_config({"disaggregation": {"min_prompt_bytes": 0},
                                         "allow_unauthenticated": True, "insecure_http": True})
    metrics = RouterMetrics()
    routing = Routing(EndpointTable(eps), settings, metrics, scorer)
    failed: list[str] = []
    record = routing.record

    def recording(rt, group, outcome, failure):
        failed.append(rt.id)
        return record(rt, group, outcome, failure=failure)
    routing.record = recording  # type: ignore[method-assign]
    return Prefill(settings, routing, metrics), metrics, failed


def run(prefill: Prefill) -> None:
    group = prefill.routing.group("m")
    body = {"model": "m", "prompt": " ".join(PROMPT), "max_tokens": 4}

    async def go():
        return await prefill.before_decode(RequestContext("r", 0.0), group, b"/v1/completions", repr(body).encode(),
                                           body, body, b"", asyncio.get_running_loop().time() + 10)
    asyncio.run(go())


def picks(metrics: RouterMetrics) -> dict[str, float]:
    return {by: metrics.prefill_picks.labels("m", by)._value.get() for by in ("cache", "load")}


def test_the_prefill_endpoint_whose_engine_holds_the_prompt_is_tried_first():
    """Fails before the choice by cache: the least loaded (the first listed, p1) was always tried first."""
    prefill, metrics, failed = phase(holder="p2")
    run(prefill)
    assert failed == ["p2", "p1"]  # both refused: the holder first, then the other, then the decoder itself
    assert picks(metrics) == {"cache": 1, "load": 1}


def test_with_no_holder_the_least_loaded_is_tried_first():
    prefill, metrics, failed = phase(holder=None)
    run(prefill)
    assert failed == ["p1", "p2"]
    assert picks(metrics) == {"cache": 0, "load": 2}
