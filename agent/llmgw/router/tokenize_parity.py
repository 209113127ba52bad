"""The parity check: does the router tokenize a model's requests exactly as its engines do?

A tokenizer directory that is not the served model's (another revision, a different chat
template, a template the engine was started with ``--chat-template`` over) makes every route
key wrong without any error: the index never matches and the router routes blind while looking
precise. So when a replica of a model with its own tokenizer first appears in the router's
table, the router POSTs the engine's ``/tokenize`` (vLLM's: ``{"model", "messages"}`` with
``tools`` for one, and ``{"model", "prompt"}``, with the replica's engine key) for a few canned
conversations and compares the ids with its own. On a mismatch, or an engine that has no ``/tokenize`` (404, 405,
an answer without ``tokens``: the engine simulator), precise routing is turned off for that model
(prefix affinity), the reason logged once, ``llmgw_router_cache_aware_parity{model}`` set to 0
and the reason shown in ``/healthz``. A replica that cannot be reached is tried again at the
next table change; a model found at odds stays off until the router restarts with a fixed
tokenizer directory.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, Mapping

from llmgw import compat

log = logging.getLogger("llmgw.router.parity")

# Canned requests: plain chat, a system prompt, multi-turn, non-ASCII, the completion path, and a
# tool-calling exchange (tools, a call with JSON arguments, its result): the engine's /tokenize
# renders tools as its chat route does, so a template, a tool_use template or a transformers
# release that renders them otherwise than the router shows here.
CANNED: tuple[dict[str, Any], ...] = (
    {"messages": [{"role": "user", "content": "Hello there, how are you today?"}]},
    {"messages": [{"role": "system", "content": "You are a careful assistant. Answer briefly."},
                  {"role": "user", "content": "What is the capital of France?"},
                  {"role": "assistant", "content": "Paris."},
                  {"role": "user", "content": "And of Italy?  Spell it   out."}]},
    {"messages": [{"role": "user", "content": "Ünïcödé, emoji 🙂 and tabs\tand\nnewlines."}]},
    {"prompt": "The quick brown fox jumps over the lazy dog. 1234567890"},
    {"messages": [{"role": "user", "content": "What is the weather in Paris?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "call-1", "type": "function",
                       "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                  {"role": "tool", "content": "Sunny, 20C.", "tool_call_id": "call-1"},
                  {"role": "user", "content": "Thanks. And tomorrow?"}],
     "tools": [{"type": "function", "function": {
         "name": "get_weather", "description": "The weather in a city.",
         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]},
)


class Unreachable(Exception):
    """The replica did not answer: try again later, decide nothing."""


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str = ""


REJECTED = "rejected"  # a canned request the tokenizer's chat template refuses (e.g. a system role)


def compare(ours: list[list[int] | str], theirs: list[list[int] | str | None]) -> Verdict:
    """Parity over the canned requests: each the engine tokenized must equal the router's ids, and
    one the template refuses must be refused by both; at least one must have been compared."""
    compared = 0
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if b is None:
            return Verdict(False, f"the engine has no usable /tokenize (canned request {i})")
        if a == REJECTED or b == REJECTED:
            if a != b:
                who = "the router's chat template" if a == REJECTED else "the engine"
                return Verdict(False, f"canned request {i}: only {who} refuses it")
            continue
        if a != b:
            n = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return Verdict(False, f"canned request {i}: the router's token ids differ from the engine's "
                                  f"from position {n} ({len(a)} ids against {len(b)})")
        compared += 1
    if not compared:
        return Verdict(False, "the chat template refuses every canned request: nothing could be compared")
    return Verdict(True)


async def engine_tokens(rt: Any, model: str, request: dict[str, Any], timeout: float) -> list[int] | str | None:
    """The engine's ids for ``request`` by ``POST /tokenize``; ``REJECTED`` when it refuses the
    request (400, 422: its template raised); None when it has no such endpoint."""
    body = json.dumps({"model": model, **request}).encode()
    head = b"Content-Type: application/json\r\nAccept: application/json\r\nAccept-Encoding: identity\r\n"

    async def post() -> tuple[int, bytes]:
        conn = await rt.get_pool().request(b"/tokenize", head, body)
        try:
            return conn.head.status, await conn.read_all(1 << 20)
        finally:
            conn.close()

    try:
        status, data = await compat.wait_for(post(), timeout)
    except Exception as e:  # connect, TLS, protocol, timeout: all "not now"
        raise Unreachable(f"{type(e).__name__}: {e}") from None
    if status in (404, 405, 501):
        return None
    if status in (400, 422):
        return REJECTED
    if status >= 500 or status in (401, 403, 429):
        raise Unreachable(f"/tokenize answered {status}")
    try:
        doc = json.loads(data)
        tokens = doc["tokens"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        return None
    return tokens


def _own_ids(tokenizer: Any, request: dict[str, Any]) -> list[int] | str:
    from .tokenize_model import Unrenderable

    try:
        return tokenizer.token_ids(request, 1 << 20)
    except Unrenderable:
        return REJECTED


class ParityCheck:
    """Checks each new replica of the models in ``scorers`` (``CacheAware`` with a model tokenizer)."""

    def __init__(self, scorers: Mapping[str, Any], timeout: float, registry: Any = None) -> None:
        from prometheus_client import CollectorRegistry, Gauge

        self.scorers = dict(scorers)
        self.timeout = timeout
        self.checked: set[str] = set()  # replica ids compared (either verdict)
        self.deferred: dict[str, float] = {}  # replica id -> loop time of its next try
        self.results: dict[str, dict[str, Any]] = {}  # model -> healthz entry
        self.gauge = Gauge("llmgw_router_cache_aware_parity",
                           "1: the router's token ids equal the engines' /tokenize on canned requests (or no "
                           "replica checked yet); 0: precise routing off for the model (reason in /healthz)",
                           ["model"], registry=registry if registry is not None else CollectorRegistry())
        for model in self.scorers:
            self.gauge.labels(model).set(1)
            self.results[model] = {"parity": "unchecked"}

    async def check_replica(self, rt: Any) -> None:
        model = rt.endpoint.model
        scorer = self.scorers[model]
        loop = asyncio.get_running_loop()
        ours: list[list[int] | str] = []
        theirs: list[list[int] | str | None] = []
        for req in CANNED:
            theirs.append(await engine_tokens(rt, model, req, self.timeout))
            ours.append(await loop.run_in_executor(None, _own_ids, scorer.model_tokenizer, req))
        self.checked.add(rt.id)
        v = compare(ours, theirs)
        if v.ok:
            if scorer.enabled:
                self.results[model] = {"parity": "ok", "replica": rt.id}
            return
        if scorer.enabled:
            reason = f"replica {rt.id}: {v.reason}"
            scorer.disable(reason)
            self.gauge.labels(model).set(0)
            self.results[model] = {"parity": "mismatch", "reason": reason}
            log.warning("cache-aware routing of %s falls back to prefix affinity: %s", model, reason)

    def _due(self, rt: Any, now: float) -> bool:
        model = rt.endpoint.model
        return (model in self.scorers and rt.id not in self.checked and self.scorers[model].enabled
                and self.deferred.get(rt.id, 0.0) <= now)

    async def sweep(self, routing: Any) -> None:
        """Check every replica of a checked model not yet compared; an unreachable one is tried
        again ``timeout`` seconds later. Replicas gone from the table are forgotten: replica ids
        are never reused, and a fleet that rolls its replicas for months must not grow these sets."""
        loop = asyncio.get_running_loop()
        runtimes = list(routing.runtimes())
        live = {rt.id for rt in runtimes}
        self.checked &= live
        for rid in set(self.deferred) - live:
            del self.deferred[rid]
        for rt in runtimes:
            if not self._due(rt, loop.time()):
                continue
            try:
                await self.check_replica(rt)
                self.deferred.pop(rt.id, None)
            except Unreachable as e:
                self.deferred[rt.id] = loop.time() + self.timeout
                log.info("parity check of %s (%s) deferred: %s", rt.id, rt.endpoint.model, e)
            except Exception:  # a bug here must not end the checks of every later replica
                self.deferred[rt.id] = loop.time() + self.timeout
                log.exception("parity check of %s (%s) failed", rt.id, rt.endpoint.model)

    async def run(self, routing: Any, interval: float = 0.5) -> None:
        """A background job: sweeps while some replica of a checked model was not compared yet."""
        loop = asyncio.get_running_loop()
        while True:
            routing.sync()
            if any(self._due(rt, loop.time()) for rt in routing.runtimes()):
                await self.sweep(routing)
            await asyncio.sleep(interval)

    def status(self) -> dict[str, Any]:
        return {m: dict(v) for m, v in self.results.items()}
