"""Route keys from the engines' KV events, through real processes, and no prompt on the wire.

A real control plane, agents and the engine simulator publishing vLLM's KV events over the
shard's ipc:// sockets (a profile with ``kv_events``). Completions store the prompts' blocks; the
agent's relay turns the events into route keys and sends them up the stream; the control plane
logs every ``kv_routes`` it receives (at DEBUG, as the fleet harness runs it) and serves them on
the watch. The keys are exactly what the router-side hash of the same prompts gives, neither a
prompt word nor a token id appears in any ``kv_routes``, a router's index follows the watch, and a
standalone router with ``cache_aware`` sends prompts sharing a prefix to the replica caching it.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import httpx
import pytest

from fleet import Fleet, router_endpoints, standalone_router
from llmgw.router.endpoints import EndpointTable
from llmgw.router.kvindex import KVIndex
from llmgw.router.watch import watch_endpoints
from llmgw.tls.context import client_context
from llmgw.kvroutekeys import chain_keys, to_hex
from llmgw.sim.sim_kvcache import DEFAULT_BLOCK_SIZE, token_ids
from tests.support.polling import until

pytestmark = pytest.mark.integration

WORDS = [f"secretword{i}" for i in range(3 * DEFAULT_BLOCK_SIZE + 5)]  # three full blocks


def kv_messages(log: str) -> list[dict]:
    return [json.loads(m) for m in re.findall(r"kv_routes from \S+: (\{.*\})$", log, re.M)]


def keys_reported(log: str) -> set[str]:
    held: set[str] = set()
    for msg in kv_messages(log):
        for e in msg["replicas"]:
            if e.get("reset"):
                held.clear()
            held -= set(e.get("removed", ()))
            held |= set(e.get("added", ()))
    return held


def test_route_keys_reach_the_control_plane_and_a_routers_index_and_no_prompt_does(tmp_path):
    """Completions through the router store the prompts' blocks; the keys reach the control plane
    (its debug log of every kv_routes) and, through the watch, the router's own watch client with
    a router certificate, whose index holds each prompt's whole chain for the replica. A poll
    waiting on the endpoint set is answered by a route-key change (batched), not after the 30 s
    long poll. No prompt word and no token id is in any kv_routes."""
    with Fleet(tmp_path, nodes={"a": 1}, replicas=1, router=True, profile={"kv_events": True}) as f:
        f.start()
        (replica,) = f.wait_ready(1)
        rid = replica["replica_id"]
        ctx = client_context(f.pki.ca_cert, *f.pki.router)
        table, index = EndpointTable(), KVIndex()
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        task = asyncio.run_coroutine_threadsafe(watch_endpoints(f.url, ctx, None, table, kv_index=index), loop)
        prompts = [WORDS, WORDS[:DEFAULT_BLOCK_SIZE] + [f"otherword{i}" for i in range(2 * DEFAULT_BLOCK_SIZE)]]
        try:
            until(lambda: index.synced_at is not None and table.revision > 0, "the first watch answer",
                  on_timeout=f.dump)
            for words in prompts:
                r = httpx.post(f"{f.router_url}/v1/completions", verify=f.router_verify(), timeout=60,
                               json={"model": "tiny", "prompt": " ".join(words), "max_tokens": 2})
                assert r.status_code == 200, r.text
                chain = chain_keys(token_ids(words), DEFAULT_BLOCK_SIZE)
                assert len(chain) == 3
                until(lambda: index.held_prefix(rid, chain) == len(chain), "the prompt's chain in the router's index",
                      timeout=25, on_timeout=f.dump)  # under the 30 s long poll: a change answers it
            assert index.fresh(rid, time.monotonic())
        finally:
            task.cancel()
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0.1), loop).result(10)  # the cancellation runs
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            loop.close()

        ids = [t for words in prompts for t in token_ids(words)]
        want = {to_hex(k) for words in prompts for k in chain_keys(token_ids(words), DEFAULT_BLOCK_SIZE)}
        until(lambda: want <= keys_reported(f.server.output(10**7)), "the prompts' route keys in kv_routes",
              on_timeout=f.dump)
        log = f.server.output(10**7)
        lines = [line for line in log.splitlines() if "kv_routes from" in line]
        assert all(rid in line for line in lines)
        for needle in ["secretword", "otherword", *map(str, ids)]:
            assert not any(needle in line for line in lines), needle
        # the stream carried them without a hitch: one connection, no refusal of the new type
        assert "not sent by agents" not in log and "invalid kv_routes" not in log
        assert f.agents["a"].output().count("connected to") == 1
        # the operator's view: the keys held (both prompts' chains share their first block) and a reset
        (shown,) = f.ready_replicas()
        assert shown["route_keys"]["keys"] == 5 and shown["route_keys"]["resets"] >= 1, shown["route_keys"]
        out = f.ctl("replicas").stdout
        row = next(line.split() for line in out.splitlines() if line.startswith(rid))
        assert row[-2] == "5" and re.fullmatch(r"\d+[smh]", row[-1]), out  # ROUTE KEYS, KV FEED's age
        assert "    route keys: " in out and "reset(s)" in out, out


def watch_route_keys(f: Fleet) -> dict:
    with httpx.Client(base_url=f.url, verify=client_context(f.pki.ca_cert, *f.pki.router), timeout=60) as c:
        r = c.get("/v1/router/endpoints", params={"kv_after": "-1"})
        r.raise_for_status()
        return r.json()["route_keys"]


def router_health(port: int) -> dict:
    return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=30).json()


def prefix_hits(f: Fleet) -> dict[str, float]:
    out = {}
    for rep in f.ready_replicas():
        port = next(s["port"] for s in rep["shards"] if s["rank"] == 0)
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        out[rep["replica_id"]] = sum(float(v) for v in re.findall(r"^vllm:prefix_cache_hits_total(?:\{[^}]*\})? (\S+)$",
                                                                  text, re.M))
    return out


def router_counter(port: int, name: str, **labels: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return sum(float(v) for lbl, v in re.findall(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M)
               if ",".join(sorted(lbl.split(","))) == want)


def test_a_standalone_router_sends_a_shared_prefix_to_the_replica_that_caches_it(tmp_path):
    """Two replicas; the first prompt of a prefix lands on one (prefix affinity: nothing is cached
    yet). Once the router's index holds that replica's keys, every later prompt sharing the prefix
    but not its first 1,024 characters (so approximate affinity would scatter them) goes there and
    hits its cache: the engines' own prefix-cache counters say so. Then groups sharing a system
    prompt, several users each, streamed and not: the tokens the router predicted cached agree
    with those the engines reported in their usage, and a client that did not ask for the usage
    event does not get it."""
    profile = {"kv_events": True, "extra_args": ["--enable-prompt-tokens-details"]}
    with Fleet(tmp_path, nodes={"a": 2}, replicas=2, profile=profile) as f:
        f.start()
        f.wait_ready(2)
        router, port = standalone_router(f, extra={"balancing": {"cache_aware": {"models": ["tiny"]}}})
        until(lambda: router_endpoints(port) == 2, "the router to see both replicas", on_timeout=router.output)
        shared = WORDS[:3 * DEFAULT_BLOCK_SIZE]
        url = f"http://127.0.0.1:{port}/v1/completions"

        def send(tail: str) -> None:
            r = httpx.post(url, timeout=60, json={"model": "tiny", "prompt": " ".join(shared + [tail] * 20),
                                                  "max_tokens": 1})
            assert r.status_code == 200, r.text

        send("first")
        want = {to_hex(k) for k in chain_keys(token_ids(shared), DEFAULT_BLOCK_SIZE)}

        def holder():
            doc = watch_route_keys(f)
            held = [e["replica_id"] for e in doc["replicas"] if want <= set(e.get("added", ()))]
            return (held[0], doc["revision"]) if held else None

        rid, revision = until(holder, "the prefix's route keys on the watch", on_timeout=f.dump)
        until(lambda: router_health(port).get("route_keys", {}).get("revision", -1) >= revision,
              "the router's index to hold them", on_timeout=router.output)
        before = prefix_hits(f)
        for i in range(6):
            send(f"tail{i}")
        after = prefix_hits(f)
        gained = {r: after[r] - before[r] for r in after}
        assert gained[rid] == 6 * len(shared), (gained, rid)
        assert sum(gained.values()) == gained[rid], gained

        # predicted against reported, on groups of users sharing a system prompt
        groups = [[f"group{g}word{i}" for i in range(3 * DEFAULT_BLOCK_SIZE)] for g in range(3)]

        def ask(words: list[str], stream: bool) -> None:
            body = {"model": "tiny", "prompt": " ".join(words), "max_tokens": 2, "stream": stream}
            r = httpx.post(url, timeout=60, json=body)
            assert r.status_code == 200, r.text
            if stream:
                assert '"usage"' not in r.text and r.text.rstrip().endswith("data: [DONE]"), r.text

        for g, system in enumerate(groups):  # each group's first user: nothing cached, prefix affinity
            ask(system + [f"g{g}user0"] * 20, False)
        chains = [{to_hex(k) for k in chain_keys(token_ids(system), DEFAULT_BLOCK_SIZE)} for system in groups]

        def all_held():
            doc = watch_route_keys(f)
            held = [set().union(*(e.get("added", ()) for e in doc["replicas"]))]
            return doc["revision"] if all(c <= held[0] for c in chains) else None

        revision = until(all_held, "every group's route keys on the watch", on_timeout=f.dump)
        until(lambda: router_health(port).get("route_keys", {}).get("revision", -1) >= revision,
              "the router's index to hold them", on_timeout=router.output)
        for user in range(1, 4):
            for g, system in enumerate(groups):
                ask(system + [f"g{g}user{user}"] * 20, stream=user % 2 == 1)
        name = "llmgw_router_cache_{}_total"
        placed = router_counter(port, name.format("predictions"), model="tiny", outcome="reported")
        predicted = router_counter(port, name.format("predicted_tokens"), model="tiny")
        reported = router_counter(port, name.format("reported_tokens"), model="tiny")
        assert placed >= 6 + 9, placed  # the index placed every request after a prefix's first
        assert router_counter(port, name.format("predictions"), model="tiny", outcome="unreported") == 0
        assert reported >= (6 + 9) * len(shared), (predicted, reported)
        assert abs(predicted - reported) <= 0.05 * reported, (predicted, reported)
