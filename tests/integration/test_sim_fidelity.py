"""The simulator against a real engine: the same OpenAI requests to ``llama-server`` and to
``llmgw-engine-sim``, compared as a client sees them.

What must agree is what clients and the router depend on: the fields of a completion,
``finish_reason`` under ``max_tokens`` and ``stop``, ``usage`` arithmetic, ``n`` choices,
SSE framing (``data: {json}`` events, the ``include_usage`` chunk, ``data: [DONE]``),
and an error body carrying ``message``, ``type`` and the HTTP status as ``code``. Where llama.cpp and vLLM differ the simulator stays
vLLM's (docs/testing.md lists the differences); those are asserted here too, so a
change in either side shows.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from realengine import needs_llama_server, start_llama_server
from simproc import start_sim
from tinymodel import write_model

pytestmark = [pytest.mark.integration, needs_llama_server]

MODEL = "tiny"
WEATHER = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("fidelity")
    model = root / "tiny.gguf"
    write_model(model)
    with start_llama_server(model, MODEL, root) as llama, \
            start_sim(model=str(model), extra_args=("--served-model-name", MODEL, "--tool-call-parser", "hermes"),
                      log_dir=root) as sim:
        yield {"llama.cpp": llama, "sim": sim}


def each(engines, fn):
    """``fn(client, base_url)`` for both engines: {name: result}."""
    out = {}
    for name, e in engines.items():
        c = openai.OpenAI(base_url=e.base_url, api_key="unused", max_retries=0, timeout=60)
        out[name] = fn(c, e.base_url)
    return out


CHAT = [{"role": "user", "content": "hello there"}]


def test_chat_completion_fields_finish_and_usage_agree(engines):
    got = each(engines, lambda c, _: c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5))
    for name, r in got.items():
        (ch,) = r.choices
        assert r.object == "chat.completion" and r.id and r.created and r.model, name
        assert ch.index == 0 and ch.message.role == "assistant" and isinstance(ch.message.content, str), name
        assert ch.finish_reason == "length", name
        u = r.usage
        assert u.completion_tokens == 5 and u.prompt_tokens > 0 and u.total_tokens == u.prompt_tokens + 5, name


def test_completions_stop_cuts_before_the_stop_string_on_both(engines):
    def run(c, _):
        full = c.completions.create(model=MODEL, prompt="Once upon", max_tokens=16, temperature=0).choices[0].text
        stop = full[4:6]
        cut = c.completions.create(model=MODEL, prompt="Once upon", max_tokens=16, temperature=0, stop=[stop])
        return full, stop, cut.choices[0]

    for name, (full, stop, choice) in each(engines, run).items():
        assert choice.finish_reason == "stop", name
        assert choice.text == full[:full.index(stop)], name


def test_n_gives_n_choices_on_both_and_only_vllm_sums_their_usage(engines):
    got = each(engines, lambda c, _: c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, n=2))
    for name, r in got.items():
        assert sorted(ch.index for ch in r.choices) == [0, 1], name
        assert all(ch.finish_reason == "length" for ch in r.choices), name
    assert got["sim"].usage.completion_tokens == 6, "vLLM counts every choice's tokens"
    assert got["llama.cpp"].usage.completion_tokens == 3, "llama.cpp counts one choice's"


def sse(base_url: str, path: str, body: dict) -> tuple[str, list[str]]:
    """(content type, raw event lines) of a streamed request."""
    with httpx.stream("POST", f"{base_url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return r.headers["content-type"], list(r.iter_lines())


@pytest.mark.parametrize("path, body", [
    ("/chat/completions", {"messages": CHAT}),
    ("/completions", {"prompt": "Once upon"}),
])
def test_sse_framing_and_the_usage_chunk_agree(engines, path, body):
    for name, e in engines.items():
        ctype, lines = sse(e.base_url, path, {"model": MODEL, "max_tokens": 4, "stream": True,
                                              "stream_options": {"include_usage": True}, **body})
        assert ctype.startswith("text/event-stream"), (name, ctype)
        events = [line for line in lines if line]
        assert all(line.startswith("data: ") for line in events), (name, events)
        assert all(line == "" for line in lines[1::2]), (name, "one blank line after each event")
        assert events[-1] == "data: [DONE]", name
        chunks = [json.loads(line[6:]) for line in events[:-1]]
        assert len({c["id"] for c in chunks}) == 1, (name, "every chunk of a stream carries its id")
        (usage,) = [c for c in chunks if c.get("usage")]
        assert usage["usage"]["completion_tokens"] == 4, (name, usage)
        assert usage is chunks[-1], (name, "usage comes last, before [DONE]")
        finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch.get("finish_reason")]
        assert finishes == ["length"], (name, finishes)
        # vLLM sends usage in a chunk of its own (choices: []); so does llama.cpp for chat, while
        # its /v1/completions puts usage in the finishing chunk.
        separate = usage["choices"] == []
        assert separate == (name == "sim" or path == "/chat/completions"), (name, path, usage)


def test_a_forced_tool_call_is_a_tool_call_on_the_simulator_and_text_from_this_llama_server(engines):
    """vLLM constrains a forced call's decoding; this llama-server, with a chat template that has no
    tool format, answers text. A change on either side shows here."""
    def run(c, _):
        return c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "weather in Paris?"}],
                                         tools=WEATHER, tool_choice="required", max_tokens=8)

    got = each(engines, run)
    sim = got["sim"].choices[0]
    (call,) = sim.message.tool_calls
    assert call.type == "function" and call.id and call.function.name == "weather"
    assert json.loads(call.function.arguments) == {"city": "tok0"} and sim.finish_reason == "tool_calls"
    llama = got["llama.cpp"].choices[0]
    assert not llama.message.tool_calls and llama.message.content and llama.finish_reason == "length"


def test_error_bodies_carry_message_type_and_status_on_both(engines):
    for name, e in engines.items():
        r = httpx.post(f"{e.base_url}/chat/completions", json={"model": MODEL, "messages": "not a list"}, timeout=30)
        assert 400 <= r.status_code < 500, (name, r.status_code, r.text)
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"], name
        assert isinstance(err["type"], str) and err["code"] == r.status_code, (name, err)


def test_where_they_differ_the_simulator_is_vllm(engines):
    """An unknown model: vLLM answers 404 NotFoundError, llama.cpp serves its one model anyway."""
    unknown = {"model": "no-such-model", "messages": CHAT, "max_tokens": 1}
    sim = httpx.post(f"{engines['sim'].base_url}/chat/completions", json=unknown, timeout=30)
    assert sim.status_code == 404 and sim.json()["error"]["type"] == "NotFoundError"
    llama = httpx.post(f"{engines['llama.cpp'].base_url}/chat/completions", json=unknown, timeout=30)
    assert llama.status_code == 200
