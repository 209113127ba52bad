"""A disaggregated model placed, launched and routed by llmgw itself, through real processes.

Control plane with its in-process router (HTTPS), an agent, simulator engines launched through the real
vLLM driver: the catalog's ``disaggregation`` block becomes one prefill and one decode replica, each
started with its owned ``--kv-transfer-config`` and its own side channel (read back from /proc), the
control plane publishes their roles (the prefill replica once a real one-token prefill -> decode round
trip proved the transfer), the router runs both phases (the decoder counts the pull in its
``vllm:nixl_*`` metrics), the answer is the aggregated one, and killing the prefill engine loses no request.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import httpx
import openai

from tests.integration.fleet import Fleet
from tests.support.polling import until

LONG = " ".join(f"w{i}" for i in range(600))  # well over min_prompt_bytes
EXPECTED = "tok0 tok1 tok2 tok3 tok4 tok5"  # what the simulator answers aggregated, for any prompt


def engine(pid: int) -> tuple[list[str], dict[str, str]]:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    env = dict(e.split("=", 1) for e in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in e)
    return argv, env


def xfer_count(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:nixl_xfer_time_seconds_count"))


def test_a_disaggregated_model_is_placed_launched_and_served_in_two_phases(tmp_path):
    with Fleet(tmp_path, nodes={"a": 2}, router=True) as f:
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

        # the prefill engine dies under load: no request is lost
        failures: list[BaseException] = []
        answers: list[str] = []
        stop = threading.Event()

        def load():
            while not stop.is_set():
                try:
                    answers.append(client.completions.create(model="tiny", prompt=LONG, max_tokens=6).choices[0].text)
                except BaseException as e:  # noqa: BLE001 - every failure is the test's finding
                    failures.append(e)
        worker = threading.Thread(target=load)
        worker.start()
        try:
            until(lambda: len(answers) >= 2, "requests flowing before the kill")
            os.killpg(seen["kv_producer"][4], signal.SIGKILL)
            n = len(answers)
            until(lambda: len(answers) >= n + 4, "requests served after the prefill engine died", on_timeout=f.dump)
        finally:
            stop.set()
            worker.join(timeout=90)
        assert failures == []
        assert set(answers) == {EXPECTED}
