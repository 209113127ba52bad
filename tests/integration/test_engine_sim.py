"""The engine simulator as a real process, driven by the official openai client."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import httpx
import openai
import pytest

from simproc import SimStartError, sim_command, start_sim, start_sim_argv

from llmgw.catalog import Model, Profile
from llmgw.engines import LaunchContext, build_launch
from llmgw.sim.sim_tokens import expected_text
from tests.support.polling import until
from tests.support.ports import free_port

pytestmark = pytest.mark.integration

SIM_BINARY = (sys.executable, "-m", "llmgw.sim.engine")


def client(sim, **kw) -> openai.OpenAI:
    kw.setdefault("timeout", 30.0)
    return openai.OpenAI(base_url=sim.base_url, api_key=kw.pop("api_key", "unused"),
                         max_retries=0, **kw)


def metric(sim, name: str) -> float:
    text = urllib.request.urlopen(f"{sim.url}/metrics", timeout=10).read().decode()
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics:\n{text}"
    return float(m.group(1))


def post_raw(sim, path: str, data: bytes, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(f"{sim.url}{path}", data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    with start_sim(
        model="/models/sim-llama",
        extra_args=("--served-model-name", "m", "alias", "--enable-prompt-tokens-details",
                    "--max-model-len", "4096", "--tool-call-parser", "hermes"),
        env={"LLMGW_SIM_OUTPUT_TOKENS": "6", "LLMGW_SIM_EMBED_DIM": "24"},
        log_dir=tmp_path_factory.mktemp("sim"),
    ) as s:
        yield s


# ------------------------------------------------------------------------ happy paths

def test_chat_non_streaming(sim):
    r = client(sim).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hello there"}], max_tokens=5)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.model == "m"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected_text(5)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 5, 8)


def test_chat_without_max_tokens_generates_the_default_and_stops(sim):
    r = client(sim).chat.completions.create(model="alias", messages=[{"role": "user", "content": "x"}])
    assert r.choices[0].message.content == expected_text(6)
    assert r.choices[0].finish_reason == "stop"
    assert r.model == "m"  # vLLM answers with the first served name


def test_chat_streaming_with_usage(sim):
    stream = client(sim).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "count"}], max_tokens=7, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    content = [c.choices[0].delta.content for c in chunks[1:] if c.choices]
    assert "".join(content).split() == [f"tok{i}" for i in range(7)]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes == [None] * 7 + ["length"]
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (2, 7)
    assert len({c.id for c in chunks}) == 1


def test_chat_streaming_without_usage_ends_on_finish(sim):
    chunks = list(client(sim).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}], max_tokens=2, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)


def test_completions_both_ways(sim):
    c = client(sim)
    r = c.completions.create(model="m", prompt="one two three", max_tokens=4)
    assert r.object == "text_completion" and r.choices[0].text == expected_text(4)
    assert r.usage.prompt_tokens == 3
    chunks = list(c.completions.create(model="m", prompt="one", max_tokens=3, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == expected_text(3)
    assert chunks[-1].usage.completion_tokens == 3


def test_completions_batch_prompt_gives_one_choice_per_prompt(sim):
    r = client(sim).completions.create(model="m", prompt=["a", "b c"], max_tokens=2)
    assert [(ch.index, ch.text) for ch in r.choices] == [(0, "tok0 tok1"), (1, "tok0 tok1")]
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 4


def test_embeddings_deterministic_in_both_encodings(sim):
    c = client(sim)
    default = c.embeddings.create(model="m", input=["alpha", "beta"])  # the client asks for base64
    floats = c.embeddings.create(model="m", input="alpha", encoding_format="float")
    assert len(default.data) == 2 and len(default.data[0].embedding) == 24
    assert default.data[0].embedding == pytest.approx(floats.data[0].embedding, rel=1e-6)
    assert default.data[0].embedding != default.data[1].embedding
    assert sum(x * x for x in floats.data[0].embedding) == pytest.approx(1.0)
    status, body = post_raw(sim, "/v1/embeddings", json.dumps(
        {"model": "m", "input": "alpha", "encoding_format": "base64"}).encode())
    raw = struct.unpack("<24f", base64.b64decode(body["data"][0]["embedding"]))
    assert list(raw) == pytest.approx(floats.data[0].embedding, rel=1e-6)


def test_models_lists_every_served_name(sim):
    models = client(sim).models.list().data
    assert [m.id for m in models] == ["m", "alias"]
    assert all(m.owned_by == "vllm" for m in models)
    assert models[0].model_extra["max_model_len"] == 4096
    assert models[0].model_extra["root"] == "/models/sim-llama"


def test_health_is_200_with_an_empty_body(sim):
    with urllib.request.urlopen(f"{sim.url}/health", timeout=10) as r:
        assert r.status == 200 and r.read() == b""


# ------------------------------------------------------------------------ errors

def test_unknown_model_is_404_in_vllms_error_shape(sim):
    with pytest.raises(openai.NotFoundError) as e:
        client(sim).chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    assert e.value.response.json() == {"error": {
        "message": "The model `gpt-4` does not exist. Valid aliases: m, alias.", "type": "NotFoundError",
        "param": "model", "code": 404}}


def test_invalid_json_is_400_in_vllms_error_shape(sim):
    status, body = post_raw(sim, "/v1/chat/completions", b"{not json")
    assert status == 400
    assert set(body["error"]) == {"message", "type", "param", "code"}
    # vLLM answers a body its request model cannot parse with FastAPI's type and the location
    assert body["error"]["type"] == "Bad Request" and body["error"]["code"] == 400
    assert body["error"]["param"] == "body.1" and "JSON decode error" in body["error"]["message"]


def test_context_length_is_enforced(sim):
    with pytest.raises(openai.BadRequestError, match="cannot be greater than max_model_len=4096"):
        client(sim).completions.create(model="m", prompt="x", max_tokens=5000)
    # below max_model_len, max_tokens past the context's end generates up to it (vLLM 0.32)
    done = client(sim).completions.create(model="m", prompt="x", max_tokens=4096)
    assert done.choices[0].finish_reason == "length" and done.usage.total_tokens == 4096


def test_api_key_is_required_on_v1_only(tmp_path):
    with start_sim(extra_args=("--api-key", "s3cret"), log_dir=tmp_path) as s:
        with pytest.raises(openai.AuthenticationError) as e:
            client(s, api_key="wrong").models.list()
        assert e.value.response.json() == {"error": "Unauthorized"}
        assert [m.id for m in client(s, api_key="s3cret").models.list().data] == ["m"]
        assert s.health_status() == 200
        assert metric(s, "vllm:num_requests_running") == 0
        assert "s3cret" not in s.output()  # the start-up log redacts keys


def test_key_from_vllm_api_key_is_enforced_as_vllm_does(tmp_path):
    key = "engine-key-" + "x" * 32
    with start_sim(env={"VLLM_API_KEY": key}, log_dir=tmp_path) as s:
        body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 1}).encode()
        assert post_raw(s, "/v1/completions", body) == (401, {"error": "Unauthorized"})
        assert post_raw(s, "/v1/completions", body, {"Authorization": f"Basic {key}"})[0] == 401
        assert post_raw(s, "/v1/completions", body, {"Authorization": f"Bearer {key}x"})[0] == 401
        assert post_raw(s, "/v1/completions", body, {"Authorization": f"bearer {key}"})[0] == 200
        assert client(s, api_key=key).completions.create(model="m", prompt="hi", max_tokens=1).choices
        with pytest.raises(openai.AuthenticationError):
            client(s, api_key="wrong").models.list()
        for path in ("/health", "/metrics", "/version"):  # vLLM's public paths
            assert httpx.get(f"{s.url}{path}", timeout=10).status_code == 200, path
        assert key not in s.output()


# ------------------------------------------------------------------------ prefix cache, metrics

def test_prefix_cache_counters_rise_on_a_repeated_prompt(sim):
    prompt = " ".join(f"pc{i}" for i in range(40))  # 40 tokens: 2 full blocks of 16
    q0, h0 = metric(sim, "vllm:prefix_cache_queries_total"), metric(sim, "vllm:prefix_cache_hits_total")
    c = client(sim)
    first = c.completions.create(model="m", prompt=prompt, max_tokens=1)
    second = c.completions.create(model="m", prompt=prompt, max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 32
    assert metric(sim, "vllm:prefix_cache_queries_total") == q0 + 80
    assert metric(sim, "vllm:prefix_cache_hits_total") == h0 + 32


def test_token_counters(sim):
    p0, g0 = metric(sim, "vllm:prompt_tokens_total"), metric(sim, "vllm:generation_tokens_total")
    client(sim).completions.create(model="m", prompt="a b c d", max_tokens=3)
    assert metric(sim, "vllm:prompt_tokens_total") == p0 + 4
    assert metric(sim, "vllm:generation_tokens_total") == g0 + 3


def test_per_request_metrics_count_each_request(sim):
    """vLLM's per-request histograms: latencies, sizes and parameters, one sample per request."""
    names = ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
             "vllm:request_queue_time_seconds_count", "vllm:inter_token_latency_seconds_count",
             "vllm:request_generation_tokens_sum", "vllm:request_prompt_tokens_sum", "vllm:request_params_n_sum",
             "vllm:request_params_max_tokens_sum")
    before = {n: metric(sim, n) for n in names}
    client(sim).completions.create(model="m", prompt="a b c d", max_tokens=3, n=2)
    after = {n: metric(sim, n) - before[n] for n in names}
    assert after == {"vllm:time_to_first_token_seconds_count": 1, "vllm:e2e_request_latency_seconds_count": 1,
                     "vllm:request_queue_time_seconds_count": 1, "vllm:inter_token_latency_seconds_count": 2,
                     "vllm:request_generation_tokens_sum": 3, "vllm:request_prompt_tokens_sum": 4,
                     "vllm:request_params_n_sum": 2, "vllm:request_params_max_tokens_sum": 3}
    assert metric(sim, "vllm:num_preemptions_total") == 0  # it never preempts


def test_requests_beyond_max_num_seqs_wait_and_are_counted(tmp_path):
    with start_sim(extra_args=("--max-num-seqs", "1"), env={"LLMGW_SIM_FAULT": "hang"},
                   log_dir=tmp_path) as s:
        async def two_hanging_requests():
            async with httpx.AsyncClient(timeout=60) as http:
                body = {"model": "m", "prompt": "x", "max_tokens": 1}
                tasks = [asyncio.create_task(http.post(f"{s.base_url}/completions", json=body))
                         for _ in range(2)]
                for _ in range(600):
                    if (metric(s, "vllm:num_requests_running"), metric(s, "vllm:num_requests_waiting")) == (1, 1):
                        break
                    await asyncio.sleep(0.05)
                state = (metric(s, "vllm:num_requests_running"), metric(s, "vllm:num_requests_waiting"))
                for t in tasks:
                    t.cancel()
                return state
        assert asyncio.run(two_hanging_requests()) == (1, 1)


def test_concurrent_streams_each_get_every_token_once(tmp_path):
    with start_sim(env={"LLMGW_SIM_TOKEN_LATENCY": "0.005"}, log_dir=tmp_path) as s:
        async def one(i: int, c: openai.AsyncOpenAI) -> list[str]:
            stream = await c.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"stream {i}"}],
                max_tokens=20, stream=True)
            return "".join([ch.choices[0].delta.content or "" async for ch in stream]).split()

        async def run() -> list[list[str]]:
            c = openai.AsyncOpenAI(base_url=s.base_url, api_key="x", max_retries=0, timeout=60)
            try:
                return await asyncio.gather(*(one(i, c) for i in range(32)))
            finally:
                await c.close()

        results = asyncio.run(run())
        assert all(words == [f"tok{i}" for i in range(20)] for words in results)


LATENCY = 0.05  # seconds per token
# Timers may fire up to a loop tick early (uvloop rounds to milliseconds);
# each token's due time is absolute, so this slack does not accumulate.
EARLY = 0.005


def test_token_latency_paces_every_streamed_token(tmp_path):
    """Token i is written no earlier than (i + 1) x latency after the request.

    The simulator paces from a fixed origin, so one late chunk is followed by
    a shorter gap; the promise is cumulative, and only a lower bound is
    asserted (a loaded machine may always be slower).
    """
    n = 8
    with start_sim(env={"LLMGW_SIM_TOKEN_LATENCY": str(LATENCY)}, log_dir=tmp_path) as s:
        c = client(s)
        c.models.list()  # connection set up before timing starts
        t0 = time.monotonic()
        stream = c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "pace"}], max_tokens=n, stream=True)
        arrivals = [time.monotonic() - t0 for ch in stream if ch.choices and ch.choices[0].delta.content]
        assert len(arrivals) == n
        for i, t in enumerate(arrivals):
            assert t >= (i + 1) * LATENCY - EARLY, (i, arrivals)
        assert arrivals[-1] >= n * LATENCY - EARLY

        t0 = time.monotonic()
        r = c.completions.create(model="m", prompt="pace", max_tokens=n)
        assert r.usage.completion_tokens == n
        assert time.monotonic() - t0 >= n * LATENCY - EARLY


# ------------------------------------------------------------------------ faults

def test_exit_during_start_exits_1_with_a_traceback_tail(tmp_path):
    s = start_sim(env={"LLMGW_SIM_FAULT": "exit-during-start"}, wait=False, log_dir=tmp_path)
    assert s.wait() == 1
    out = s.output()
    assert "EngineCore failed to start." in out
    assert "torch.OutOfMemoryError: CUDA out of memory" in out
    assert out.rstrip().endswith("Failed core proc(s): {'EngineCore_DP0': 1}")
    assert "Application startup complete" not in out


def test_crash_after_n_tokens_breaks_the_stream_and_kills_the_process(tmp_path):
    s = start_sim(env={"LLMGW_SIM_FAULT": "crash-after:3"}, log_dir=tmp_path)
    got: list[str] = []
    with pytest.raises(openai.APIConnectionError):
        stream = client(s).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], max_tokens=10, stream=True)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                got.append(chunk.choices[0].delta.content)
    assert "".join(got) == expected_text(3)
    assert s.wait() == 1
    assert "died unexpectedly" in s.output()


def test_hang_keeps_health_but_never_produces_a_token(tmp_path):
    with start_sim(env={"LLMGW_SIM_FAULT": "hang"}, log_dir=tmp_path) as s:
        assert s.health_status() == 200
        c = client(s, timeout=openai.Timeout(30.0, read=1.0))
        with pytest.raises(openai.APITimeoutError):
            c.completions.create(model="m", prompt="x", max_tokens=2)
        # Streaming: the response starts (headers), then no event ever arrives.
        stream = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                           max_tokens=2, stream=True)
        assert stream.response.status_code == 200
        with pytest.raises(openai.APITimeoutError):
            next(iter(stream))
        assert s.health_status() == 200 and s.alive()


def test_error_chunk_after_n_tokens_is_in_band(tmp_path):
    with start_sim(env={"LLMGW_SIM_FAULT": "error-chunk-after:2"}, log_dir=tmp_path) as s:
        got: list[str] = []
        with pytest.raises(openai.APIError, match="EngineCore encountered an issue"):
            for chunk in client(s).chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "x"}], max_tokens=5, stream=True):
                if chunk.choices and chunk.choices[0].delta.content:
                    got.append(chunk.choices[0].delta.content)
        assert "".join(got) == expected_text(2)
        # On the wire: the error event, then [DONE], as vLLM's serving code writes them.
        with httpx.stream("POST", f"{s.base_url}/completions", timeout=30,
                          json={"model": "m", "prompt": "x", "max_tokens": 5, "stream": True}) as r:
            events = [e for e in r.read().decode().split("\n\n") if e]
        assert len(events) == 4
        assert json.loads(events[2].removeprefix("data: "))["error"]["type"] == "InternalServerError"
        assert events[3] == "data: [DONE]"
        assert s.alive()


def test_http_500_answers_every_completion_with_vllms_error(tmp_path):
    with start_sim(env={"LLMGW_SIM_FAULT": "http-500"}, log_dir=tmp_path) as s:
        with pytest.raises(openai.InternalServerError) as e:
            client(s).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert e.value.response.json()["error"]["code"] == 500
        with pytest.raises(openai.InternalServerError):
            client(s).completions.create(model="m", prompt="x", stream=True)
        assert s.health_status() == 200


def test_faults_that_begin_on_sigusr1_after_serving(tmp_path):
    """wedge: nothing answers, /health included; engine-dead: /health and /v1 answer 500; the process lives."""
    with start_sim(env={"LLMGW_SIM_FAULT": "wedge", "LLMGW_SIM_FAULT_ONSET": "signal"}, log_dir=tmp_path) as s:
        assert client(s).completions.create(model="m", prompt="x", max_tokens=1).choices
        s.proc.send_signal(signal.SIGUSR1)
        until_sim(lambda: s.health_status(timeout=0.5) is None, "health to stop answering", s)
        with pytest.raises(openai.APITimeoutError):
            client(s, timeout=1.0).completions.create(model="m", prompt="x", max_tokens=1)
        with pytest.raises(httpx.TimeoutException):
            httpx.get(f"{s.url}/metrics", timeout=0.5)
        assert s.alive() and "fault wedge begins" in s.output()
    with start_sim(env={"LLMGW_SIM_FAULT": "engine-dead", "LLMGW_SIM_FAULT_ONSET": "signal"},
                   log_dir=tmp_path) as s:
        assert s.health_status() == 200
        s.proc.send_signal(signal.SIGUSR1)
        until_sim(lambda: s.health_status() == 500, "health to answer 500", s)
        with pytest.raises(openai.InternalServerError, match="EngineCore encountered an issue"):
            client(s).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert s.alive()


def test_hang_after_start_keeps_health_and_freezes_the_step_counters(tmp_path):
    """vLLM's engine core stuck in a collective: /health 200, requests pile up, no engine step."""
    with start_sim(env={"LLMGW_SIM_FAULT": "hang", "LLMGW_SIM_FAULT_ONSET": "after:0.5"}, log_dir=tmp_path) as s:
        until_sim(lambda: "fault hang begins" in s.output(), "the hang to begin", s)
        steps = metric(s, "vllm:iteration_tokens_total_count")
        errors: list[BaseException] = []

        def request() -> None:
            try:
                client(s, timeout=openai.Timeout(30.0, read=3.0)).completions.create(
                    model="m", prompt="a b c", max_tokens=2)
            except BaseException as e:  # noqa: BLE001 - the timeout is the expected end
                errors.append(e)

        t = threading.Thread(target=request)
        t.start()
        until_sim(lambda: metric(s, "vllm:num_requests_running") >= 1, "the request to be running", s)
        assert s.health_status() == 200
        assert metric(s, "vllm:iteration_tokens_total_count") == steps  # admitted, never stepped
        t.join()
        assert len(errors) == 1 and isinstance(errors[0], openai.APITimeoutError)


def test_iteration_tokens_count_engine_steps(sim):
    n0, s0 = metric(sim, "vllm:iteration_tokens_total_count"), metric(sim, "vllm:iteration_tokens_total_sum")
    list(client(sim).completions.create(model="m", prompt="a b c d", max_tokens=3, stream=True))
    # one prefill step of 4 tokens, then one step per streamed token
    assert metric(sim, "vllm:iteration_tokens_total_count") == n0 + 4
    assert metric(sim, "vllm:iteration_tokens_total_sum") == s0 + 4 + 3


def until_sim(pred, what: str, s, timeout: float = 30.0) -> None:
    until(pred, what, timeout, on_timeout=s.output, interval=0.05)


# ------------------------------------------------------------------------ start-up and ranks

def test_port_is_refused_while_loading_and_sigterm_ends_startup(tmp_path):
    s = start_sim(env={"LLMGW_SIM_STARTUP_DELAY": "600"}, wait=False, log_dir=tmp_path)
    try:
        s.wait_output("Starting to load model")
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", s.port), timeout=5).close()
        # The port is reserved: a second bind fails while the first is loading.
        probe = socket.socket()
        with pytest.raises(OSError):
            probe.bind(("127.0.0.1", s.port))
        probe.close()
    finally:
        assert s.stop() == 0


def test_headless_worker_serves_nothing_and_stays_alive(tmp_path):
    port = free_port()
    s = start_sim_argv(["serve", "m", "--port", str(port), "-tp", "2", "--nnodes", "2", "--node-rank", "1",
                        "--master-addr", "127.0.0.1", "--headless"], port=port, wait=False,
                       log_dir=tmp_path)
    try:
        s.wait_output("headless multiproc executor, with head node address 127.0.0.1:29501")
        assert s.alive()
        assert s.health_status(timeout=1) is None
    finally:
        assert s.stop() == 0


def test_unknown_flag_exits_2_with_an_argparse_error():
    r = subprocess.run(sim_command(["serve", "m", "--not-a-vllm-flag"]), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2
    assert "error: unrecognized arguments: --not-a-vllm-flag" in r.stderr


def bare_env(**knobs: str) -> dict[str, str]:
    """Only ``knobs``, a PATH and the code under test (PYTHONPATH), not an installed copy."""
    env = {"PATH": "/usr/bin:/bin", **knobs}
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env


def test_bad_knob_exits_2_naming_the_variable():
    r = subprocess.run(sim_command(["serve", "m"]), capture_output=True, text=True, timeout=60,
                       env=bare_env(LLMGW_SIM_FAULT="melt"))
    assert r.returncode == 2
    assert "LLMGW_SIM_FAULT='melt'" in r.stderr


def test_unknown_timing_preset_exits_2_naming_the_variable_and_the_presets():
    env = bare_env(LLMGW_SIM_TIMING="h100-llama70b")
    r = subprocess.run(sim_command(["serve", "m"]), capture_output=True, text=True, timeout=20, env=env)
    assert r.returncode == 2
    assert "LLMGW_SIM_TIMING='h100-llama70b': unknown preset; known: vllm-cpu-tiny" in r.stderr


def test_port_already_in_use_fails_start(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(SimStartError) as e:
            start_sim(port=port, log_dir=tmp_path)
        assert e.value.returncode == 1
        assert "Address already in use" in e.value.output


# ------------------------------------------------------------------------ adapter argv, end to end

@pytest.mark.parametrize("engine,dialect,model", [
    ("vllm", (), Model("llama", "meta-llama/Llama-3.1-8B-Instruct", "llama-8b", max_model_len=2048)),
    ("sglang", ("sglang",), Model("qwen", "Qwen/Qwen2.5-7B-Instruct", "qwen")),
    ("llamacpp", ("llama-server",), Model("phi", "/models/phi.gguf", "phi3")),
])
def test_adapter_built_launch_serves_through_the_simulator(engine, dialect, model, tmp_path):
    port = free_port()
    spec = build_launch(model, Profile("p", engine, tensor_parallel_size=2), LaunchContext(
        host="127.0.0.1", port=port, model_path=model.source, gpu_indices=(0, 1),
        command=SIM_BINARY + dialect))
    assert spec.argv[:3] == SIM_BINARY
    s = start_sim_argv(spec.argv[3:], port=spec.port, env=spec.env, log_dir=tmp_path)
    try:
        r = client(s).chat.completions.create(
            model=model.served_name, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert r.choices[0].message.content == expected_text(3)
        assert [m.id for m in client(s).models.list().data] == [model.served_name]
    finally:
        assert s.stop() == 0


# ------------------------------------------- n, stop, forced tool calls (as vLLM answers them)

def test_n_returns_that_many_choices_streamed_interleaved_and_counted_in_usage(sim):
    c = client(sim)
    r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3, n=3)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert {ch.message.content for ch in r.choices} == {expected_text(3)} and r.usage.completion_tokens == 9
    chunks = list(c.completions.create(model="m", prompt="hi", max_tokens=2, n=2, stream=True,
                                       stream_options={"include_usage": True}))
    by_index: dict[int, str] = {}
    for ch in chunks:
        for choice in ch.choices:
            by_index[choice.index] = by_index.get(choice.index, "") + choice.text
    assert by_index == {0: expected_text(2), 1: expected_text(2)} and chunks[-1].usage.completion_tokens == 4


def test_stop_cuts_the_text_before_the_stop_string_streamed_or_not(sim):
    c = client(sim)
    r = c.completions.create(model="m", prompt="hi", max_tokens=10, stop=[" tok4"])
    (ch,) = r.choices
    assert (ch.text, ch.finish_reason, r.usage.completion_tokens) == (expected_text(4), "stop", 5)
    assert ch.model_extra["stop_reason"] == " tok4"
    chunks = list(c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=10, stop="k2", stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "tok0 tok1 to"
    assert chunks[-1].choices[0].finish_reason == "stop"


WEATHER = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_forced_tool_calls_come_back_in_the_tool_call_shape_and_auto_is_refused(sim):
    c = client(sim)
    msgs = [{"role": "user", "content": "weather in Paris?"}]
    r = c.chat.completions.create(model="m", messages=msgs, tools=WEATHER, tool_choice="required")
    (ch,) = r.choices
    (call,) = ch.message.tool_calls
    assert ch.finish_reason == "tool_calls" and ch.message.content == ""
    assert call.type == "function" and call.function.name == "weather"
    assert json.loads(call.function.arguments) == {"city": "tok0"}
    named = {"type": "function", "function": {"name": "weather"}}
    chunks = list(c.chat.completions.create(model="m", messages=msgs, tools=WEATHER, tool_choice=named, stream=True))
    calls = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    assert calls[0].id and calls[0].function.name == "weather"
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == {"city": "tok0"}
    assert chunks[-1].choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
        c.chat.completions.create(model="m", messages=msgs, tools=WEATHER)


def test_serves_https_with_vllms_ssl_flags_and_refuses_a_pair_it_cannot_load(tmp_path):
    """``--ssl-keyfile/--ssl-certfile`` as vLLM takes them: HTTPS only, with that certificate."""
    import ssl

    from llmgw.tls import init_ca
    from llmgw.tls.files import write_pair
    from llmgw.tls.issue import issue_engine

    ca = init_ca(tmp_path / "ca")
    crt, key = write_pair(tmp_path / "engine", *issue_engine(ca, [], ["127.0.0.1"]))
    port = free_port()
    sim = start_sim("m", port=port, extra_args=["--ssl-keyfile", str(key), "--ssl-certfile", str(crt)],
                    wait=False, log_dir=tmp_path)
    try:
        verify = ssl.create_default_context(cafile=str(ca.cert_path))
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.post(f"https://127.0.0.1:{port}/v1/completions", verify=verify, timeout=10,
                               json={"model": "m", "prompt": "hi", "max_tokens": 1})
                break
            except httpx.ConnectError:
                assert sim.alive() and time.monotonic() < deadline, sim.output()
                time.sleep(0.1)
        assert r.status_code == 200 and r.json()["choices"]
        assert f"on https://127.0.0.1:{port}" in sim.output()
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port gets no answer
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).raise_for_status()
    finally:
        sim.stop()
    bad = start_sim("m", extra_args=["--ssl-keyfile", str(key), "--ssl-certfile", str(key)], wait=False,
                    log_dir=tmp_path)
    assert bad.proc.wait(timeout=60) == 1
    assert "cannot load --ssl-certfile/--ssl-keyfile" in bad.output()
