"""An SGLang model served disaggregated by llmgw itself, through real processes: SGLang's own protocol.

Control plane with its in-process router (HTTPS), an agent, simulator engines launched through the real
SGLang driver in SGLang's dialect: the catalog's ``disaggregation`` block becomes two prefill replicas
and one decode replica, each started with ``--disaggregation-mode`` and the transfer backend, each
prefill with its own bootstrap port and every side with the node's address (read back from /proc). The
control plane publishes the decoder as needing a prefill and each prefill replica with its bootstrap
port once a real round trip (both engines at once, one room) proved the transfer. The router sends
every request to a prefill and the decode replica at once (the prefill engines count each transfer),
the answers are the aggregated ones, streamed or not, and killing a prefill engine under load loses no
request. With no prefill replica left the model answers 503 rather than sending a decoder what it
cannot compute.
"""

from __future__ import annotations

import os
import signal

import httpx
import openai
import pytest

from tests.integration.fleet import Fleet
from tests.integration.simdisagg import served_through
from tests.support import procfs
from tests.support.polling import until
from tests.support.scrape import scrape

LONG = " ".join(f"w{i}" for i in range(300))
EXPECTED = "tok0 tok1 tok2 tok3 tok4 tok5"  # what the simulator answers aggregated, for any prompt
SENT = "sglang:kv_transfer_latency_ms_count"  # a prefill engine's transfers


def engine(pid: int) -> tuple[list[str], dict[str, str]]:
    argv = procfs.argv(pid)
    env = procfs.environ(pid)
    assert env is not None, f"engine {pid} is gone"
    return argv, env


def test_an_sglang_model_is_served_by_prefill_and_decode_replicas_at_once(tmp_path):
    with Fleet(tmp_path, nodes={"a": 3}, router=True) as f:
        f.config["profiles"] = [{"name": "sg", "engine": "sglang", "start_timeout": 60}]
        f.config["deployments"] = [{"model": "tiny", "profile": "sg", "disaggregation": {
            "prefill": {"replicas": 2}, "decode": {"replicas": 1}}}]
        f.write_config()
        f.start()
        ready = f.wait_ready(3)
        by_id = {r["replica_id"]: r for r in ready}
        prefills = sorted(rid for rid, r in by_id.items() if r["profile"] == "sg:prefill")
        (decoder,) = [rid for rid, r in by_id.items() if r["profile"] == "sg:decode"]
        assert len(prefills) == 2

        # launched as SGLang's two roles; each prefill's bootstrap on a port of its own from the node's range
        launched = {}
        for pid in f.engine_pids():
            argv, env = engine(pid)
            mode = argv[argv.index("--disaggregation-mode") + 1]
            assert argv[argv.index("--disaggregation-transfer-backend") + 1] == "nixl"
            assert env["SGLANG_HOST_IP"] == "127.0.0.1"
            port = int(argv[argv.index("--port") + 1])
            boot = int(argv[argv.index("--disaggregation-bootstrap-port") + 1]) if mode == "prefill" else None
            if mode == "decode":
                assert "--disaggregation-bootstrap-port" not in argv
            launched[port] = (mode, boot, pid)
        assert sorted(m for m, _, _ in launched.values()) == ["decode", "prefill", "prefill"]
        ports = [p for p, (_, b, _) in launched.items()] + [b for _, b, _ in launched.values() if b]
        assert len(set(ports)) == 5

        def url(rid: str) -> str:
            return f"http://127.0.0.1:{by_id[rid]['shards'][0]['port']}"

        # the watch publishes the decoder as needing a prefill, and each prefill replica with its
        # bootstrap once a round trip proved it (the replicas view shows the port its agent reported)
        def watched():
            with f.client(cert=f.pki.router) as c:
                eps = c.get("/v1/router/endpoints", params={"after": "-1"}).json()["endpoints"]
            return {e["replica_id"]: (e.get("role"), e.get("bootstrap_port"), e.get("requires_prefill"))
                    for e in eps}
        boots = {rid: launched[by_id[rid]["shards"][0]["port"]][1] for rid in prefills}
        want = {decoder: ("decode", None, True), **{rid: ("prefill", boots[rid], None) for rid in prefills}}
        until(lambda: watched() == want, "both prefill replicas proved and published", on_timeout=f.dump)
        log = f.server.output(10**7)
        for rid in prefills:
            assert f"{rid}: transfer to {decoder} proved" in log
        shards = {r["replica_id"]: r["shards"][0] for r in f.replicas()["replicas"]}
        assert {rid: shards[rid]["side_port"] for rid in prefills} == boots

        # every request goes to a prefill and the decoder at once: a transfer per request, the aggregated answer
        client = openai.OpenAI(base_url=f"{f.router_url}/v1", api_key="unused", max_retries=0, timeout=60,
                               http_client=httpx.Client(verify=f.router_verify()))

        def sent() -> float:
            return sum(scrape(url(rid), (SENT,))[SENT] for rid in prefills)
        before = sent()
        assert client.completions.create(model="tiny", prompt=LONG, max_tokens=6).choices[0].text == EXPECTED
        chunks = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": LONG}],
                                                max_tokens=6, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == EXPECTED
        assert sent() == before + 2

        # a prefill engine dies under load: every request is answered (its tries go to the other one)
        victim = launched[by_id[prefills[0]]["shards"][0]["port"]][2]
        answers, failures = served_through(
            lambda: client.completions.create(model="tiny", prompt=LONG, max_tokens=6).choices[0].text,
            lambda: os.killpg(victim, signal.SIGKILL), 6, on_timeout=f.dump)
        assert failures == []
        assert set(answers) == {EXPECTED}


@pytest.mark.parametrize("stream", [False, True])
def test_without_a_prefill_replica_an_sglang_model_is_unavailable_not_sent_to_its_decoder(tmp_path, stream):
    with Fleet(tmp_path, nodes={"a": 1}, router=True) as f:
        f.config["profiles"] = [{"name": "sg", "engine": "sglang", "start_timeout": 60}]
        # the prefill group asks for two GPUs on a node of one: only the decoder runs
        f.config["deployments"] = [{"model": "tiny", "profile": "sg", "disaggregation": {
            "prefill": {"replicas": 1, "tensor_parallel_size": 2}, "decode": {"replicas": 1}}}]
        f.write_config()
        f.start()
        (r,) = f.wait_ready(1)
        assert r["profile"] == "sg:decode", r
        client = openai.OpenAI(base_url=f"{f.router_url}/v1", api_key="unused", max_retries=0, timeout=60,
                               http_client=httpx.Client(verify=f.router_verify()))
        with pytest.raises(openai.APIStatusError) as e:
            if stream:
                list(client.completions.create(model="tiny", prompt=LONG, max_tokens=6, stream=True))
            else:
                client.completions.create(model="tiny", prompt=LONG, max_tokens=6)
        assert e.value.status_code == 503
        assert e.value.body["code"] == "prefill_unavailable", e.value.body
        assert e.value.response.headers["retry-after"] == "1"
