"""A model's own tokenizer through the router's real request path (in-process router and engines
over real sockets): the forwarder awaits the token ids before the pick, so a prompt goes to the
replica whose route keys hold it; the parity check against the engines' ``/tokenize`` keeps
precise routing on when they agree and turns it off, visibly, when they do not; a tokenization
that misses its deadline is served by prefix affinity and counted."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time

from aiohttp import web

from llmgw.kvroutekeys import chain_keys, to_hex
from llmgw.router.app import build_app
from llmgw.router.endpoints import Endpoint, EndpointTable
from llmgw.router.kvindex import KVIndex
from llmgw.router.settings import RouterSettings
from llmgw.router.tokenize_model import ModelTokenizer
from proxy_harness import BASE, Engine, Router
from tests.support.tinytokenizer import model_dir

CP = {"url": "https://cp:1", "ca": "/ca", "cert": "/c", "key": "/k"}
BS = 4
CHAT = {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": "hi there a b c d e f g h"}]}


class CacheAwareRouter(Router):
    def __init__(self, endpoints, tokenizer_dir, index: KVIndex, **cache_aware):
        settings = RouterSettings.from_config({**BASE, "control_plane": CP, "balancing": {"cache_aware": {
            "models": ["m"], "model_tokenizers": {"m": str(tokenizer_dir)}, "block_size": BS, **cache_aware}}})
        # the index is this test's, not a watch's: no control plane (nor its CA) to reach
        self.settings = dataclasses.replace(settings, control_plane=None)
        self.table = EndpointTable(endpoints)
        self.app = build_app(self.settings, self.table, kv_index=index)

    async def health(self) -> dict:
        async with self.http.get(self.url + "/healthz") as r:
            return await r.json()


def engine(tokens_for):
    """An engine answering /tokenize with ``tokens_for(request)`` and any other POST with a completion."""
    async def behaviour(request: web.Request, body: bytes) -> web.Response:
        if request.path == "/tokenize":
            return web.json_response({"tokens": tokens_for(json.loads(body))})
        return web.json_response({"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}]})
    return Engine(behaviour)


def index_holding(replica: str, keys: list[int], others: list[str]) -> KVIndex:
    index = KVIndex(stale_after=60)
    index.apply({"epoch": "e", "revision": 1, "full": True, "replicas": [
        {"replica_id": r, "reset": True, "added": [to_hex(k) for k in keys] if r == replica else []}
        for r in [replica, *others]]}, time.monotonic())
    return index


async def until_parity(router: CacheAwareRouter) -> dict:
    for _ in range(200):
        doc = (await router.health())["tokenizer_parity"]["m"]
        if doc["parity"] != "unchecked":
            return doc
        await asyncio.sleep(0.05)
    raise AssertionError("no parity verdict")


def run(tmp_path, agree: bool, rounds: int = 4, patch=None, **cache_aware):
    tok = ModelTokenizer.from_directory(str(model_dir(tmp_path)))
    keys = chain_keys(tok.token_ids(CHAT, 1000), BS)
    assert len(keys) >= 4

    def tokens_for(req: dict) -> list[int]:
        ids = tok.token_ids(req, 10**6)
        return ids if agree else ids[:1] + ids[2:]

    async def main():
        engines = [await engine(tokens_for).start() for _ in range(3)]
        eps = [Endpoint(id=f"e{i}", model="m", url=e.url, replica_id=f"r{i}") for i, e in enumerate(engines)]
        router = CacheAwareRouter(eps, model_dir(tmp_path), index_holding("r2", keys, ["r0", "r1"]), **cache_aware)
        try:
            async with router:
                parity = await until_parity(router)
                if patch is not None:
                    patch(router.routing.scorer.scorers["m"])
                for _ in range(rounds):
                    status, _, body = await router.post(body=CHAT)
                    assert status == 200, body
                served = [sum(1 for _, b in e.requests if json.loads(b) == CHAT) for e in engines]
                metrics = {
                    "parity": await router.metric("llmgw_router_cache_aware_parity", model="m"),
                    "timeouts": await router.metric("llmgw_router_tokenize_fallbacks_total", model="m",
                                                    reason="timeout")}
                return parity, served, metrics, router.routing.scorer.scorers["m"]
        finally:
            for e in engines:
                await e.stop()

    return asyncio.run(main())


def test_prompts_go_to_the_replica_holding_their_blocks_when_the_engines_agree(tmp_path):
    parity, served, metrics, scorer = run(tmp_path, agree=True)
    assert parity["parity"] == "ok" and metrics["parity"] == 1
    assert served == [0, 0, 4] and (scorer.precise, scorer.fell_back) == (4, 0)


def test_engines_that_tokenize_otherwise_turn_precise_routing_off_visibly(tmp_path):
    parity, served, metrics, scorer = run(tmp_path, agree=False)
    assert parity["parity"] == "mismatch" and "from position 1" in parity["reason"], parity
    assert metrics["parity"] == 0
    assert sum(served) == 4 and (scorer.precise, scorer.fell_back) == (0, 4)


def test_a_tokenization_past_its_deadline_is_routed_by_affinity_and_counted(tmp_path):
    release = threading.Event()

    def stall(scorer):
        real = scorer.model_tokenizer

        class Stuck:
            def token_ids(self, payload, n):
                release.wait(5)
                return real.token_ids(payload, n)

        scorer.model_tokenizer = Stuck()

    try:
        parity, served, metrics, scorer = run(tmp_path, agree=True, rounds=2, patch=stall, tokenize_deadline=0.05)
    finally:
        release.set()
    assert parity["parity"] == "ok"
    assert sum(served) == 2 and metrics["timeouts"] == 2 and (scorer.precise, scorer.fell_back) == (0, 2)
