"""KV events from a live vLLM (the CPU build), decoded by llmgw.kvevents, replayed by sequence.

The session's shared engine (conftest's ``shared_vllm``: a minute to start on 2 cores, so it is
started once), serving the tiny random Llama with prefix caching and KV events on ipc:// sockets.
What it proves against the real engine, not a recording: a SUB socket receives numbered batches;
prompts that share a prefix publish BlockStored events whose token_ids are the prompt's and whose
parent is the shared block; the prefix-cache counters on /metrics agree; and a subscriber that was
away gets what it missed from the replay socket, by sequence number, then the end marker. And that
the router's own tokenizer (``router.tokenize_model``, from the model directory) makes the engine's
token ids of chat and completion requests, so the route keys it computes are those the engine's
events give, tool-calling chat requests included.
"""

from __future__ import annotations

import asyncio
import re
import shutil
from itertools import count
from types import SimpleNamespace

import httpx
import pytest
import zmq

from llmgw.agent.kvrelay_map import RouteMap
from llmgw.kvevents import BlockStored, Message
from llmgw.kvroutekeys import chain_keys
from llmgw.router.tokenize_model import EngineChatSettings, ModelTokenizer, Unrenderable
from llmgw.router.tokenize_parity import ParityCheck
from llmgw.router.upstream import Pool
from realvllm import SHARED_AUTH as AUTH, SHARED_TOPIC as TOPIC
from realvllm import tiny_hf_model, vllm_python  # noqa: F401 (fixtures; shared_vllm is conftest's)
from tests.support.kvsub import Subscriber, replay
from tests.support.polling import until
from tests.support.tinytokenizer import TOOLS_TEMPLATE

pytestmark = pytest.mark.integration

SHARED = [10 + (i * 7) % 400 for i in range(64)]  # two full blocks of 32
_unique = count(1)


def tail(seed: int, n: int = 32) -> list[int]:
    return [10 + (seed * 31 + i * 13) % 400 for i in range(n)]


@pytest.fixture(scope="module")
def engine(shared_vllm):
    ctx = zmq.Context()
    yield shared_vllm.engine, shared_vllm.kv, ctx
    ctx.destroy(linger=0)


def complete(eng, prompt: list[int], max_tokens: int = 1) -> dict:
    r = httpx.post(f"{eng.base_url}/completions", timeout=120, headers=AUTH,
                   json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    r.raise_for_status()
    return r.json()


def counter(eng, name: str) -> float:
    text = httpx.get(f"{eng.url}/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def joined(eng, sub: Subscriber) -> None:
    """PUB/SUB drops what is published before a subscription reaches the publisher: send
    throwaway prompts (each a new block) until one's event arrives."""
    def probe() -> list[Message] | None:
        complete(eng, tail(1000 + next(_unique)))
        try:
            return until(sub.pump, "an event", timeout=5, error=TimeoutError)
        except TimeoutError:
            return None
    until(probe, "the subscription to reach the publisher", interval=0)


def test_shared_prefix_chains_and_replay_after_a_subscriber_restart(engine):
    eng, kv, ctx = engine
    sub = Subscriber(ctx, kv["endpoint"], TOPIC)
    joined(eng, sub)

    a, b = SHARED + tail(1), SHARED + tail(2)
    complete(eng, a)
    (first,) = until(lambda: sub.stored(a), "the first prompt's BlockStored")
    assert first.parent_block_hash is None and len(first.block_hashes) == 3 and first.block_size == 32
    hits = counter(eng, "vllm:prefix_cache_hits_total")
    complete(eng, b)
    # only the block after the shared 64 tokens is new, chained to the second shared block
    (second,) = until(lambda: sub.stored(b[64:]), "the second prompt's BlockStored")
    assert second.parent_block_hash == first.block_hashes[1]
    until(lambda: counter(eng, "vllm:prefix_cache_hits_total") - hits == 64, "64 prefix-cache hit tokens")
    seqs = [m.seq for m in sub.got]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))

    # the subscriber goes away; a third prompt extends the chain while nobody listens
    last = sub.got[-1].seq
    sub.close()
    c = b + tail(3)
    complete(eng, c)
    missed = until(lambda: [m for m in replay(ctx, kv["replay_endpoint"], last + 1) for e in m.batch.events
                            if isinstance(e, BlockStored) and e.parent_block_hash == second.block_hashes[0]],
                   "the missed batch in the replay")
    (third,) = [e for e in missed[0].batch.events if isinstance(e, BlockStored)]
    assert third.token_ids == tuple(c[96:]) and missed[0].seq > last and missed[0].topic == TOPIC

    # a restarted subscriber catches up from the start: the same batches, in order, no gaps
    everything = replay(ctx, kv["replay_endpoint"], 0)
    assert [m.seq for m in everything] == list(range(len(everything)))
    assert everything[seqs[0]:seqs[0] + len(seqs)] == sub.got


class _Keys:
    def __init__(self) -> None:
        self.held: set[int] = set()

    def add(self, key: int) -> None:
        self.held.add(key)

    def remove(self, key: int) -> None:
        self.held.discard(key)

    def reset(self) -> None:
        self.held.clear()


def test_the_routers_tokenizer_makes_the_engines_ids_and_route_keys(engine, tiny_hf_model):  # noqa: F811
    eng, kv, ctx = engine
    tok = ModelTokenizer.from_directory(str(tiny_hf_model))
    n = next(_unique)
    words = " ".join(f"token{(n * 7 + i * 3) % 97} and, more: Ünï {i}" for i in range(10))  # ~250 ids: under --max-model-len 512
    chat = {"messages": [{"role": "system", "content": f"Conversation {n}. Be brief."},
                         {"role": "user", "content": words}]}
    prompt = {"prompt": f"Request {n}: {words}"}
    ours = {}
    for name, req in (("chat", chat), ("prompt", prompt)):
        ours[name] = tok.token_ids(req, 10**6)
        r = httpx.post(f"{eng.url}/tokenize", json={"model": "tiny", **req}, timeout=60)
        r.raise_for_status()
        assert ours[name] == r.json()["tokens"], name
    assert len(ours["chat"]) > 64 and len(ours["prompt"]) > 64

    httpx.post(f"{eng.base_url}/chat/completions", timeout=120, headers=AUTH,
               json={"model": "tiny", **chat, "max_tokens": 1, "temperature": 0}).raise_for_status()
    httpx.post(f"{eng.base_url}/completions", timeout=120, headers=AUTH,
               json={"model": "tiny", **prompt, "max_tokens": 1, "temperature": 0}).raise_for_status()

    def engine_keys() -> set[int]:  # the route keys the agent's map makes of every event so far
        sink = _Keys()
        m = RouteMap(sink)
        for msg in replay(ctx, kv["replay_endpoint"], 0):
            m.apply(msg.batch.events)
        return sink.held

    for name, ids in ours.items():
        want = set(chain_keys(ids, 32))
        assert len(want) >= 2
        until(lambda: want <= engine_keys(), f"the {name} request's route keys among the engine's")

    # the parity check agrees with this engine: precise routing stays on
    class Scorer:
        model_tokenizer = tok
        enabled = True

        def disable(self, reason: str) -> None:
            self.enabled = False
            raise AssertionError(reason)

    async def check() -> dict:
        rt = SimpleNamespace(id="vllm-0", endpoint=SimpleNamespace(model="tiny"),
                             get_pool=lambda p=Pool(eng.url, 10, 30): p)
        parity = ParityCheck({"tiny": Scorer()}, timeout=60)
        await parity.check_replica(rt)
        return parity.status()

    assert asyncio.run(check()) == {"tiny": {"parity": "ok", "replica": "vllm-0"}}


def test_the_routers_tokenizer_renders_a_tool_calling_request_as_the_engine(engine, tiny_hf_model, tmp_path):  # noqa: F811
    """The tiny model's own chat template reads neither tools, documents nor kwargs, so both sides
    use one that does: the router a copy of the model directory whose chat_template.jinja it is,
    the engine (started with --trust-request-chat-template) the same text as the request's
    ``chat_template``, which vLLM renders exactly as its own (``resolve_chat_template``: a given
    template first). /tokenize takes the chat fields the chat route renders, documents only through
    chat_template_kwargs."""
    eng, _kv, _ctx = engine
    model = tmp_path / "tools-model"
    shutil.copytree(tiny_hf_model, model)
    (model / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    tok = ModelTokenizer.from_directory(str(model))
    call = {"id": "call-1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": [1, 2], "ü": null}'}}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather by city.",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}},
                                               "strict": True}},
             {"type": "function", "function": {"name": "now", "unknown": 1}}]  # null description, no parameters
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": [{"type": "text", "text": "Sunny"}, {"type": "text", "text": "20C"}],
                 "tool_call_id": "call-1"},
                {"role": "assistant", "content": "Sunny, 20C."}, {"role": "user", "content": "Thanks."}]
    requests = [
        {"messages": messages, "tools": tools, "chat_template_kwargs": {"enable_thinking": False}},
        {"messages": messages, "tools": tools, "chat_template_kwargs": {"enable_thinking": True, "documents": [
            {"title": "Forecast", "text": "Rain later."}]}},
        {"messages": messages[:4], "tools": tools, "add_generation_prompt": False, "continue_final_message": True},
    ]
    for i, req in enumerate(requests):
        ours = tok.token_ids(req, 10**6)
        r = httpx.post(f"{eng.url}/tokenize", timeout=60,
                       json={"model": "tiny", **req, "chat_template": TOOLS_TEMPLATE})
        r.raise_for_status()
        assert ours == r.json()["tokens"], i
    assert tok.token_ids(requests[0], 10**6) != tok.token_ids(requests[1], 10**6)
    # the chat route itself, with documents as a request field and tool_choice "none" (any other
    # choice needs a tool parser): this engine keeps the tools, as it runs without
    # --exclude-tools-when-tool-choice-none; a router not told so cannot say
    chat = {"messages": messages, "tools": tools, "tool_choice": "none", "documents": [{"title": "A", "text": "B"}],
            "chat_template_kwargs": {"enable_thinking": False}}
    with pytest.raises(Unrenderable):
        tok.token_ids(chat, 10**6)
    told = ModelTokenizer.from_directory(str(model), EngineChatSettings(exclude_tools_when_tool_choice_none=False))
    r = httpx.post(f"{eng.base_url}/chat/completions", timeout=120, headers=AUTH,
                   json={"model": "tiny", **chat, "chat_template": TOOLS_TEMPLATE, "return_token_ids": True,
                         "max_tokens": 1, "temperature": 0})
    r.raise_for_status()
    assert told.token_ids(chat, 10**6) == r.json()["prompt_token_ids"]
