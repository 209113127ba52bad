"""A disaggregated model on two real vLLM CPU engines over NIXL, placed, launched and routed by llmgw.

A control plane (with its in-process router) and one agent whose ``engines.vllm`` is vLLM's CPU build
(``vllmcpu.ENTRY``): the deployment's ``disaggregation`` block becomes one prefill and one decode
replica of the tiny HF Llama, each started by the vLLM driver as its side of the pair (owned
``--kv-transfer-config``, ``VLLM_NIXL_SIDE_CHANNEL_HOST``/``PORT`` from the agent) with the profile's
UCX settings for TCP on loopback (docs/disaggregation.md). The prefill replica reaches the router only
once the control plane proved a real one-token prefill -> decode round trip (``pairproof``). Proves
what the simulator cannot: the parameters the router forwards are ones a real decoder accepts (it
pulls the blocks: NIXL transfers are counted), the answers are token for token the decoder's own
greedy answers, a bogus transfer costs the client nothing, and neither does killing the prefill
engine under load. Both engines start together; one fleet serves the module (about 90 s).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

import vllmcpu
from fleet import Fleet, metric_samples
from realengine import client, engine_fleet
from realvllm import tiny_hf_model, vllm_python  # noqa: F401 (fixtures)
from tests.integration.router_support import RouterProcess, openai_client, router_doc
from tests.support import procfs
from tests.support.polling import until
from tests.support.procfs import live, tree_pids

pytestmark = pytest.mark.integration

HEALTH = {"interval": 0.5, "timeout": 10, "fail_after": 120}  # checked often, failed only when truly wedged
# UCX over TCP on loopback, as docs/disaggregation.md says for tests and CPU builds
UCX_ENV = {"UCX_TLS": "tcp,self,sm", "UCX_NET_DEVICES": "lo"}
# token ids: three full 32-token blocks and a tail each, no two prompts sharing a block
PROMPTS = [[(7 * i + 3 + 41 * k) % 200 + 10 for i in range(100)] for k in range(3)]
MAX_TOKENS = 8
XFERS = "vllm:nixl_xfer_time_seconds_count"
# transfers, handshakes and notifications that failed, counted together
FAILED = "vllm:nixl_num_failed_transfers_total"


@dataclass
class Engine:
    replica_id: str
    pid: int
    url: str
    key: str

    def complete(self, prompt: list[int], **extra) -> str:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
        r = httpx.post(f"{self.url}/v1/completions", json=body, timeout=120,
                       headers={"Authorization": f"Bearer {self.key}"})
        r.raise_for_status()
        return r.json()["choices"][0]["text"]

    def counter(self, name: str) -> float:
        # generous: a CPU engine's API server shares two cores with the whole suite, and once took more
        # than 10 s to answer a scrape right after a failed pull; the counts, not its speed, are asserted
        text = httpx.get(f"{self.url}/metrics", timeout=60).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def environ(pid: int) -> dict[str, str]:
    env = procfs.environ(pid)
    assert env is not None, f"engine {pid} is gone"
    return env


@dataclass
class Pair:
    f: Fleet
    prefill: Engine
    decode: Engine
    alone: list[str]  # the decoder's own greedy answer to each prompt, prefilled locally


@pytest.fixture(scope="module")
def pair(vllm_python, tiny_hf_model, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("vllm-pd")
    f = engine_fleet(root, "vllm", [str(vllm_python), *vllmcpu.ENTRY],
                     models=[{"name": "tiny", "source": str(tiny_hf_model), "max_model_len": 512}],
                     profiles=[{"name": "cpu", "engine": "vllm", "start_timeout": 600,
                                "extra_args": list(vllmcpu.ENGINE_ARGS), "env": {**vllmcpu.ENGINE_ENV, **UCX_ENV}}],
                     deployments=[{"model": "tiny", "profile": "cpu", "disaggregation": {
                         "prefill": {"replicas": 1}, "decode": {"replicas": 1}}}],
                     agent={"health": HEALTH}, gpus=2,
                     # a killed engine is not started again within the module: a third vLLM start
                     # would cost a minute of CPU for nothing the tests look at
                     restart={"backoff_initial": 3600, "backoff_max": 3600})
    f.config["router"]["disaggregation"] = {"min_prompt_bytes": 0, "min_uncached_tokens": 0}  # every prompt
    f.write_config()
    with f:
        f.start()
        ready = f.wait_ready(2, timeout=600)
        engines = {}
        for r in ready:
            (s,) = r["shards"]
            engines[r["profile"].rsplit(":", 1)[1]] = Engine(r["replica_id"], s["pid"], f"http://127.0.0.1:{s['port']}",
                                                            environ(s["pid"])["VLLM_API_KEY"])
        prefill, decode = engines["prefill"], engines["decode"]

        # the prefill replica reaches the router once its round trip to the decoder is proved
        def watched():
            with f.client(cert=f.pki.router) as c:
                eps = c.get("/v1/router/endpoints", params={"after": "-1"}).json()["endpoints"]
            return {e["replica_id"]: e.get("role") for e in eps}
        until(lambda: watched() == {prefill.replica_id: "prefill", decode.replica_id: "decode"},
              "the prefill replica proved and published", timeout=120, on_timeout=f.dump)
        # the reference: each prompt computed by the decoder alone, under a cache salt so that the
        # routed requests find none of its blocks cached and pull every one of them
        alone = [decode.complete(p, cache_salt="alone") for p in PROMPTS]
        yield Pair(f, prefill, decode, alone)


def test_the_pair_is_launched_by_llmgw_as_the_two_sides_of_nixl(pair):
    seen = {}
    for eng in (pair.prefill, pair.decode):
        argv = procfs.argv(eng.pid)
        env = environ(eng.pid)
        conf = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert conf["kv_connector"] == "NixlConnector"
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1" and env["UCX_TLS"] == UCX_ENV["UCX_TLS"]
        seen[conf["kv_role"]] = int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
    assert set(seen) == {"kv_producer", "kv_consumer"} and len(set(seen.values())) == 2
    assert f"{pair.prefill.replica_id}: transfer to {pair.decode.replica_id} proved" in pair.f.server.output(10**7)


def pulls_reach(pair: Pair, count: float, what: str) -> None:
    """Wait for the decoder's NIXL pull count to reach ``count``. vLLM publishes connector stats
    with a later engine step's output, so the count of a request's pull may trail its answer
    until the decoder steps again: a one-token request of its own (its own cache salt, so it
    computes and pulls nothing) makes it step while we wait."""
    nudges = iter(range(10**6))

    def reached() -> bool:
        if pair.decode.counter(XFERS) >= count:
            return True
        pair.decode.complete(PROMPTS[0], max_tokens=1, cache_salt=f"nudge-{next(nudges)}")
        return pair.decode.counter(XFERS) >= count

    until(reached, what, timeout=120, interval=2, on_timeout=lambda: pair.f.dump() + "\n" + repr(
        {k: v for k, v in metric_samples(pair.f).items() if "prefill" in k}))


def test_routed_answers_are_the_decoders_own_and_its_blocks_cross_over_nixl(pair):
    c = client(pair.f)
    pulled = pair.decode.counter(XFERS)
    for prompt, alone in zip(PROMPTS, pair.alone):
        got = c.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert got.choices[0].text == alone
    pulls_reach(pair, pulled + len(PROMPTS), "the decoder to count a pull for each routed prompt")


class KeyedProxy:
    """An engine's API in front of it, with its engine key; ``tamper`` may rewrite a JSON answer."""

    def __init__(self, engine: Engine, tamper: Callable[[dict], None] | None = None) -> None:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def _forward(self, body: bytes | None) -> None:
                req = urllib.request.Request(engine.url + self.path, data=body, method=self.command, headers={
                    "Authorization": f"Bearer {engine.key}", "Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(req, timeout=120) as r:
                        status, data = r.status, r.read()
                except urllib.error.HTTPError as e:
                    status, data = e.code, e.read()
                if tamper is not None and status == 200 and self.command == "POST":
                    doc = json.loads(data)
                    tamper(doc)
                    data = json.dumps(doc).encode()
                if self.command == "POST":
                    proxy.answered.append(status)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self._forward(None)

            def do_POST(self) -> None:  # noqa: N802
                self._forward(self.rfile.read(int(self.headers["Content-Length"])))

            def log_message(self, *args) -> None:
                pass

        self.answered: list[int] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_bogus_transfer_is_served_by_the_decoder_not_a_500(pair, tmp_path):
    """The prefill engine answers for real, but its ``kv_transfer_params`` name an engine its side channel
    does not serve (the id rewritten on the way back): the decoder's NIXL handshake finds the mismatch
    and fails the pull (vLLM 0.32's ``kv_load_failure_policy`` ``fail``: HTTP 500), and the router sends
    the request again without the parameters. The parameters keep the shape a decoder needs, so only the
    real decoder can tell; a standalone router with static roles sits in front of the two proxies."""

    def bogus(doc: dict) -> None:
        doc["kv_transfer_params"]["remote_engine_id"] = "not-" + doc["kv_transfer_params"]["remote_engine_id"]

    prefill, decode = KeyedProxy(pair.prefill, bogus), KeyedProxy(pair.decode)
    try:
        eps = [{"id": "p", "model": "tiny", "url": prefill.url, "role": "prefill"},
               {"id": "d", "model": "tiny", "url": decode.url, "role": "decode"}]
        with RouterProcess(router_doc(eps, disaggregation={"min_prompt_bytes": 0, "min_uncached_tokens": 0}), tmp=tmp_path) as router:
            failed = pair.decode.counter(FAILED)
            got = openai_client(router).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                                           temperature=0)
            assert got.choices[0].text == pair.alone[0]
            assert router.metric("llmgw_router_prefill_total", model="tiny", outcome="ok") == 1
            assert decode.answered == [500, 200], decode.answered  # the pull failed; the retry prefilled
            until(lambda: pair.decode.counter(FAILED) > failed, "the decoder to count the failure",
                  timeout=60)
    finally:
        prefill.close()
        decode.close()
    # and the decoder still pulls from the real prefill engine
    pulled = pair.decode.counter(XFERS)
    got = client(pair.f).completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0)
    assert got.choices[0].text == pair.alone[1]
    pulls_reach(pair, pulled + 1, "a pull after the bogus one")


def test_sigkill_of_the_prefill_engine_under_load_fails_no_request(pair):
    """Last: it kills the prefill engine. The whole process tree dies (API server, EngineCore, worker),
    as on a host that lost it: a SIGKILL of the API server alone would leave its EngineCore running."""
    c = client(pair.f)
    failures: list[BaseException] = []
    answers: list[tuple[int, str]] = []
    stop = threading.Event()

    def load() -> None:
        k = 0
        while not stop.is_set():
            k = (k + 1) % len(PROMPTS)
            try:
                got = c.completions.create(model="tiny", prompt=PROMPTS[k], max_tokens=MAX_TOKENS, temperature=0)
                answers.append((k, got.choices[0].text))
            except BaseException as e:  # noqa: BLE001 - every failure is the test's finding
                failures.append(e)
    workers = [threading.Thread(target=load) for _ in range(2)]
    for w in workers:
        w.start()
    tree: set[int] = set()
    try:
        until(lambda: len(answers) >= 2, "requests flowing before the kill", timeout=120)
        tree = tree_pids(pair.prefill.pid)
        assert len(tree) > 1, tree  # the API server and the engine's own processes
        for pid in sorted(tree):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        n = len(answers)
        until(lambda: len(answers) >= n + 4, "requests served after the prefill engine died", timeout=120,
              on_timeout=pair.f.dump)
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=150)
    assert failures == []
    assert all(text == pair.alone[k] for k, text in answers), answers
    # no process of the killed engine is left spinning
    until(lambda: not (tree & {p for p, st in live().items() if st.state not in ("Z", "X")}),
          "the killed engine's processes to be gone", timeout=30)
