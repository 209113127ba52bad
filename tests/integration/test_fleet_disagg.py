"""A disaggregated model placed, launched and routed by llmgw itself, through real processes.

Control plane with its in-process router (HTTPS), an agent, simulator engines launched through the real
vLLM driver: the catalog's ``disaggregation`` block becomes one prefill and one decode replica, each
started with its owned ``--kv-transfer-config`` and its own side channel (read back from /proc), the
control plane publishes their roles (the prefill replica once a real one-token prefill -> decode round
trip proved the transfer), the router runs both phases (the decoder counts the pull in its
``vllm:nixl_*`` metrics), the answer is the aggregated one, and killing the prefill engine loses no request.

The remote-prefill rule, with the engines' KV events feeding a standalone cache-aware router's index:
a conversation's second turn, whose prefix the decoder holds since its first, is computed on the
decoder (no pull); a new long prompt is prefilled remotely again.
"""

from __future__ import annotations

import json
import os
import signal

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from llmgw.kvroutekeys import chain_keys, to_hex
from llmgw.router.kvindex_tokens import simulator_token_ids
from llmgw.sim.sim_kvcache import DEFAULT_BLOCK_SIZE
from tests.integration.fleet import Fleet, router_endpoints, standalone_router
from tests.integration.simdisagg import served_through
from tests.support import procfs
from tests.support.polling import until

LONG = " ".join(f"w{i}" for i in range(600))  # well over min_prompt_bytes
EXPECTED = "tok0 tok1 tok2 tok3 tok4 tok5"  # what the simulator answers aggregated, for any prompt
# a conversation: 600 tokens (over min_uncached_tokens' 512), then the same with a few more
FIRST = [{"role": "user", "content": " ".join(f"c{i}" for i in range(600))}]
SECOND = FIRST + [{"role": "assistant", "content": EXPECTED}, {"role": "user", "content": "and then?"}]
OTHER = [{"role": "user", "content": " ".join(f"v{i}" for i in range(600))}]


def engine(pid: int) -> tuple[list[str], dict[str, str]]:
    argv = procfs.argv(pid)
    env = procfs.environ(pid)
    assert env is not None, f"engine {pid} is gone"
    return argv, env


def xfer_count(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:nixl_xfer_time_seconds_count"))


def decisions(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {s.labels["decision"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "llmgw_router_prefill_decisions_total" and s.labels.get("model") == "tiny"}


def the_decoders_cache_decides(f: Fleet, decoder: str, decode_url: str) -> None:
    """A standalone router with the route-key index: a second turn the decoder holds is not pulled."""
    router, port = standalone_router(f, extra={
        "balancing": {"cache_aware": {"models": ["tiny"]}},
        "disaggregation": {"min_prompt_bytes": 1024}})  # min_uncached_tokens: its default, 512
    until(lambda: router_endpoints(port) == 2, "the router to see the pair", on_timeout=router.output)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)

    def chat(messages) -> str:
        return client.chat.completions.create(model="tiny", messages=messages, max_tokens=6).choices[0].message.content

    pulled = xfer_count(decode_url)
    assert chat(FIRST) == EXPECTED
    assert xfer_count(decode_url) == pulled + 1  # nothing of it cached on the decoder: prefilled remotely

    # the decoder's engine reports the first turn's blocks as KV events; the router's index gets them
    want = {to_hex(k) for k in chain_keys(simulator_token_ids({"messages": FIRST}, 8192), DEFAULT_BLOCK_SIZE)}

    def held() -> int | None:
        with f.client(cert=f.pki.router) as c:
            doc = c.get("/v1/router/endpoints", params={"kv_after": "-1"}).json()["route_keys"]
        ok = any(e["replica_id"] == decoder and want <= set(e.get("added", ())) for e in doc["replicas"])
        return doc["revision"] if ok else None

    revision = until(held, "the first turn's route keys for the decoder on the watch", on_timeout=f.dump)
    until(lambda: httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).json()
          .get("route_keys", {}).get("revision", -1) >= revision, "the router's index to hold them",
          on_timeout=router.output)

    # the second turn: the 600 tokens the decoder holds and a few it does not: computed there
    assert chat(SECOND) == EXPECTED
    assert xfer_count(decode_url) == pulled + 1
    assert chat(OTHER) == EXPECTED  # a new long prompt is worth the transfer
    assert xfer_count(decode_url) == pulled + 2
    assert decisions(port) == {"remote": 2.0, "cached": 1.0}


def test_a_disaggregated_model_is_placed_launched_and_served_in_two_phases(tmp_path):
    with Fleet(tmp_path, nodes={"a": 2}, router=True, profile={"kv_events": True}) as f:
        f.config["deployments"] = [{"model": "tiny", "profile": "sim", "disaggregation": {
            "prefill": {"replicas": 1}, "decode": {"replicas": 1}}}]
        f.config["router"]["disaggregation"] = {"min_prompt_bytes": 1024}
        f.write_config()
        f.start()
        ready = f.wait_ready(2)
        by_role = {r["profile"].rsplit(":", 1)[1]: r for r in ready}
        assert set(by_role) == {"prefill", "decode"}

        # launched as each side of the pair, each with its own side channel
        seen = {}
        for pid in f.engine_pids():
            argv, env = engine(pid)
            conf = json.loads(argv[argv.index("--kv-transfer-config") + 1])
            seen[conf["kv_role"]] = (conf["kv_connector"], env["VLLM_NIXL_SIDE_CHANNEL_HOST"],
                                     int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]), int(argv[argv.index("--port") + 1]),
                                     pid)
        assert set(seen) == {"kv_producer", "kv_consumer"}
        assert {s[0] for s in seen.values()} == {"NixlConnector"} and {s[1] for s in seen.values()} == {"127.0.0.1"}
        ports = [p for s in seen.values() for p in s[2:4]]
        assert len(set(ports)) == 4  # side channels and HTTP ports all distinct, from the node's range

        # ctl explain says which role each replica has and why it went where
        explained = f.ctl("explain", "tiny").stdout
        assert "tiny/sim:prefill: running as" in explained and "tiny/sim:decode: running as" in explained
        assert "decode: GPU" in explained and "KV transfers within" in explained, explained

        def shard_url(r):
            (s,) = r["shards"]
            return f"http://127.0.0.1:{s['port']}"
        decode_url = shard_url(by_role["decode"])

        # the prefill replica reaches the routers once a one-token prefill -> decode round trip proved
        # the transfer (the decoder counted the pull); the watch that feeds standalone routers and the
        # in-process router get the same set, each endpoint with its role
        def watched():
            with f.client(cert=f.pki.router) as c:
                eps = c.get("/v1/router/endpoints", params={"after": "-1"}).json()["endpoints"]
            return {e["replica_id"]: e.get("role") for e in eps}
        want = {by_role[k]["replica_id"]: k for k in ("prefill", "decode")}
        until(lambda: watched() == want, "the prefill replica proved and published", on_timeout=f.dump)
        assert f"{by_role['prefill']['replica_id']}: transfer to {by_role['decode']['replica_id']} proved" \
            in f.server.output(10**7)
        assert xfer_count(decode_url) >= 1  # the proof's own pull

        # the router runs both phases: the decoder pulls the prompt's blocks, the answer is the aggregated one
        client = openai.OpenAI(base_url=f"{f.router_url}/v1", api_key="unused", max_retries=0, timeout=60,
                               http_client=httpx.Client(verify=f.router_verify()))
        for _ in range(2):
            pulled = xfer_count(decode_url)
            got = client.completions.create(model="tiny", prompt=LONG, max_tokens=6)
            assert got.choices[0].text == EXPECTED
            assert xfer_count(decode_url) == pulled + 1

        # whether to prefill remotely: the prompt less what the chosen decoder caches
        the_decoders_cache_decides(f, by_role["decode"]["replica_id"], decode_url)

        # the prefill engine dies under load: no request is lost
        answers, failures = served_through(
            lambda: client.completions.create(model="tiny", prompt=LONG, max_tokens=6).choices[0].text,
            lambda: os.killpg(seen["kv_producer"][4], signal.SIGKILL), 4, on_timeout=f.dump)
        assert failures == []
        assert set(answers) == {EXPECTED}


def prompt_tokens(url: str) -> float:
    """The prompt tokens an engine computed (vLLM's counter; the simulator keeps the same name)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prompt_tokens_total"))


def test_a_prompt_goes_to_the_prefill_replica_whose_engine_holds_its_prefix(tmp_path):
    """Two prefill replicas publishing KV events, each holding the first turn of a conversation of its
    own: each conversation's second turn is prefilled by the replica that holds its first, though
    the least-loaded rule (both idle) would send both to the same one."""
    with Fleet(tmp_path, nodes={"a": 3}, profile={"kv_events": True}) as f:
        f.config["deployments"] = [{"model": "tiny", "profile": "sim", "disaggregation": {
            "prefill": {"replicas": 2}, "decode": {"replicas": 1}}}]
        f.write_config()
        f.start()
        ready = f.wait_ready(3)
        prefill = {r["replica_id"]: f"http://127.0.0.1:{r['shards'][0]['port']}" for r in ready
                   if r["profile"].endswith(":prefill")}
        keys_of = {r["replica_id"]: engine(r["shards"][0]["pid"])[1]["VLLM_API_KEY"] for r in ready}
        assert len(prefill) == 2
        conversations = dict(zip(sorted(prefill), (FIRST, OTHER)))
        # each prefill engine computes one first turn (sent to it directly, with its engine key) and
        # reports its blocks
        for rid, messages in conversations.items():
            r = httpx.post(f"{prefill[rid]}/v1/chat/completions", timeout=60,
                           headers={"Authorization": f"Bearer {keys_of[rid]}"},
                           json={"model": "tiny", "messages": messages, "max_tokens": 1})
            assert r.status_code == 200, r.text

        def keys(messages) -> set[str]:
            return {to_hex(k) for k in chain_keys(simulator_token_ids({"messages": messages}, 8192), DEFAULT_BLOCK_SIZE)}

        def held() -> int | None:
            with f.client(cert=f.pki.router) as c:
                doc = c.get("/v1/router/endpoints", params={"kv_after": "-1"}).json()["route_keys"]
            have = {e["replica_id"]: set(e.get("added", ())) for e in doc["replicas"]}
            ok = all(keys(m) <= have.get(rid, set()) for rid, m in conversations.items())
            return doc["revision"] if ok else None

        revision = until(held, "both prefill replicas' route keys on the watch", on_timeout=f.dump)
        # every prompt remote (min_uncached_tokens 0): the decoder's own cache decides nothing here
        router, port = standalone_router(f, extra={
            "balancing": {"cache_aware": {"models": ["tiny"]}},
            "disaggregation": {"min_prompt_bytes": 0, "min_uncached_tokens": 0}})
        until(lambda: router_endpoints(port) == 3, "the router to see the three replicas", on_timeout=router.output)
        until(lambda: httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).json()
              .get("route_keys", {}).get("revision", -1) >= revision, "the router's index to hold them",
              on_timeout=router.output)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)

        for rid, first in conversations.items():
            second = first + [{"role": "assistant", "content": EXPECTED}, {"role": "user", "content": "and then?"}]
            before = {p: prompt_tokens(url) for p, url in prefill.items()}
            assert client.chat.completions.create(model="tiny", messages=second, max_tokens=6) \
                .choices[0].message.content == EXPECTED
            assert [p for p, url in prefill.items() if prompt_tokens(url) > before[p]] == [rid]
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        picks = {s.labels["by"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                 if s.name == "llmgw_router_prefill_picks_total" and s.labels.get("model") == "tiny"}
        assert picks.get("cache") == 2.0, picks
