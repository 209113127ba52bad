"""The prefill phase of a disaggregated model: a remote prefill before the request goes to a decoder.

A model whose endpoints include some with ``role: prefill`` is served in two
phases, as vLLM's NixlConnector expects (``llmgw.kvtransfer``): the request
goes first to a prefill endpoint with ``kv_transfer_params`` asking it to hold
the prompt's KV blocks for a remote decoder (``stream`` false, ``max_tokens``
1), and its answer's ``kv_transfer_params`` go verbatim on the original request
to a decode endpoint, whose connector pulls the blocks instead of computing
them. The decode side is the model's ordinary group (``decode`` and ``both``
endpoints), balanced, retried and ejected as any model's.

Disaggregation never costs the client a request: a prefill that fails (an
engine error, a timeout, an answer the decoder could not use) is tried once
more on another prefill endpoint, and after that the request goes to the
decoder as it came, which prefills it itself. A decode that fails before its
first byte is retried without the parameters (the blocks may be gone).
Prefill endpoints are ejected on their own failures, as a group of their own.

Whether to prefill remotely at all is llm-d's prefix-based P/D rule (its
inference scheduler's P/D decider plugin, ``prefix-based-pd-decider``, earlier
``prefix-disaggregation-decider``, with ``nonCachedTokens``): the
decode endpoint is chosen first, by the model's balancer as for any request,
and the prompt goes to a prefill endpoint only when what that decoder would
still have to compute, the prompt less the part it already caches, is at least
``disaggregation.min_uncached_tokens``. Below it, the transfer and the extra hop
cost more than computing the rest where it will be decoded: the second turn of
a long conversation, whose first turn the decoder holds, is not moved over the
fabric again. As in llm-d the cached part is the longest leading run of the
prompt's blocks the decoder holds; unlike the approximate prefix index that
llm-d's decider reads, it is read
from the route-key index the engines' own KV events feed (``kvindex``,
``balancing.cache_aware``), so it is what the engine holds, not what was sent to
it. A model the index does not cover, or a decoder whose feed is stale or
absent, counts as caching nothing: the rule is then prompt length alone (llm-d
skips the remote prefill when it cannot read the cache state; here a long
prompt is still worth its transfer, as when the body's size alone decided). ``min_uncached_tokens``
0 sends every prompt remote (llm-d's 0 turns disaggregation off). Prompt
length is the router's token ids where it tokenized the request (cache-aware
models), else llm-d's estimate of 4 characters of prompt text a token. Bodies
under ``disaggregation.min_prompt_bytes`` skip all of this (a cheap first gate).
The prefill then prepares the blocks for that decoder, and the decode request
goes to it (unless it has become unusable meanwhile, or fails: then as any
retry). Each decision is counted with its reason (``DECISIONS``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

from llmgw.kvtransfer import PREFILL_REQUEST, check_prefill_params

from .balancing import ByModel, CacheAware, prefix_text
from .context import RequestContext
from .errors import RouterError
from .failures import classify_exception, endpoint_fault, status_failure
from .metrics import RouterMetrics
from .runtime import EndpointRuntime, ModelGroup, Routing
from .settings import Disaggregation, RouterSettings
from .upstream import request_whole

log = logging.getLogger("llmgw.router")

_PATHS = (b"/v1/completions", b"/v1/chat/completions")
TRIES = 2  # prefill endpoints tried before the decoder prefills itself
CHARS_PER_TOKEN = 4  # llm-d's estimate where the router has no token ids

# Why a request of a disaggregated model was, or was not, prefilled remotely
# (``llmgw_router_prefill_decisions_total{decision}``).
REMOTE = "remote"  # long enough uncached on the chosen decoder: a prefill endpoint computes it
SHORT = "short"  # the prompt itself is under the threshold (bytes or tokens): the decoder computes it
CACHED = "cached"  # long enough, but the decoder caches enough of it that the rest is under the threshold
NO_PREFILL_ENDPOINT = "no_prefill_endpoint"  # remote was wanted; no prefill endpoint could take it
DECISIONS = (REMOTE, SHORT, CACHED, NO_PREFILL_ENDPOINT)


@dataclass(frozen=True)
class Decision:
    reason: str  # one of DECISIONS
    prompt_tokens: int  # as counted (or estimated) by the router
    cached_tokens: int  # on the chosen decoder; 0 where the index cannot say

    @property
    def remote(self) -> bool:
        return self.reason == REMOTE


def decide(prompt_tokens: int, cached_tokens: int, min_uncached_tokens: int, prefill_available: bool) -> Decision:
    """llm-d's rule: remote only when the prompt less the decoder's cached part reaches the threshold."""
    cached = min(max(cached_tokens, 0), prompt_tokens)
    if prompt_tokens - cached < min_uncached_tokens:
        reason = CACHED if cached and prompt_tokens >= min_uncached_tokens else SHORT
    else:
        reason = REMOTE if prefill_available else NO_PREFILL_ENDPOINT
    return Decision(reason, prompt_tokens, cached)


def estimate_tokens(payload: dict[str, Any] | None, body_len: int) -> int:
    """The prompt's length in tokens without a tokenizer: token-id prompts as they are, text at
    ``CHARS_PER_TOKEN`` characters a token (the body's length bounds the text's)."""
    prompt = (payload or {}).get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return len(prompt)
    return math.ceil(len(prefix_text(payload, body_len)) / CHARS_PER_TOKEN)


def cache_view(scorer: Any, model: str) -> CacheAware | None:
    """The model's cache-aware scorer, whose index says what each replica's engine holds; None: none."""
    if isinstance(scorer, ByModel):
        scorer = scorer.scorers.get(model)
    return scorer if isinstance(scorer, CacheAware) else None


def prompt_on(view: CacheAware | None, decoder: Any, route_payload: dict[str, Any] | None,
              payload: dict[str, Any], body_len: int) -> tuple[int, int]:
    """(prompt tokens, tokens ``decoder`` caches of it): from the index where it speaks for the
    decoder, else an estimate with nothing cached."""
    held = view.held_tokens(decoder, route_payload) if view is not None else None
    if held is None:
        return estimate_tokens(payload, body_len), 0
    counted, cached = held
    if counted >= view.max_tokens:  # the router keys only the first max_tokens: the prompt may be longer
        counted = max(counted, estimate_tokens(payload, body_len))
    return counted, cached


def prefill_cache(view: CacheAware | None, route_payload: dict[str, Any] | None
                  ) -> tuple[Callable[[Any], int | None], float] | None:
    """How many of the prompt's leading tokens a prefill endpoint's engine holds (None where the index
    cannot say), and the load bound the choice keeps; None for a model the index does not cover.

    As for the decoder, what the engine holds is read from the route-key index its KV events feed,
    so a prefill group whose engines publish them (``kv_events`` on the prefill profile) sends a
    prompt whose prefix one of them holds to that one, which computes only the rest."""
    if view is None:
        return None
    return view.holdings(route_payload), view.fallback.load_bound


def prefill_body(payload: dict[str, Any]) -> bytes:
    """The prefill phase's request: the client's, not streamed, one token, blocks held for a decoder."""
    req = {**payload, "stream": False, "max_tokens": 1, "kv_transfer_params": dict(PREFILL_REQUEST)}
    req.pop("stream_options", None)
    if "max_completion_tokens" in req:
        req["max_completion_tokens"] = 1
    return json.dumps(req, separators=(",", ":")).encode()


def decode_body(payload: dict[str, Any], params: dict[str, Any]) -> bytes:
    """The client's request carrying the prefill's ``kv_transfer_params``, as it answered them."""
    return json.dumps({**payload, "kv_transfer_params": params}, separators=(",", ":")).encode()


class Prefill:
    def __init__(self, settings: RouterSettings, routing: Routing, metrics: RouterMetrics) -> None:
        self.s: Disaggregation = settings.disaggregation
        self.routing = routing
        self.metrics = metrics

    def applies(self, group: ModelGroup, target: bytes) -> bool:
        """Whether the rule is asked at all: a completion for a disaggregated model. (No client's request
        carries transfer parameters: ``request.parse_body`` refuses them.)"""
        return group.prefill is not None and target.split(b"?", 1)[0] in _PATHS

    async def before_decode(self, ctx: RequestContext, group: ModelGroup, target: bytes, body: bytes,
                            payload: dict[str, Any], route_payload: dict[str, Any] | None, headers: bytes,
                            total_deadline: float) -> tuple[EndpointRuntime | None, bytes]:
        """The decoder the decision was made for (None: none chosen yet) and the body for it: the
        client's, or the client's with a remote prefill's ``kv_transfer_params``."""
        if not self.applies(group, target):
            return None, body
        if len(body) < self.s.min_prompt_bytes:
            self._count(group.model, SHORT)
            return None, body
        decoder = self.routing.pick(group, set(), route_payload)
        if isinstance(decoder, RouterError):
            raise decoder
        if decoder is None:  # not with nothing tried; the forwarder's own pick says why
            return None, body
        if ctx.cache is not None:  # read at the pick: the scorer keeps only its last pick's
            ctx.cache.predicted = self.routing.predicted(group)
        assert group.prefill is not None
        tokens, cached = prompt_on(cache_view(self.routing.scorer, group.model), decoder, route_payload,
                                   payload, len(body))
        available = self.routing.pick_prefill(group.prefill, set()) is not None
        decision = decide(tokens, cached, self.s.min_uncached_tokens, available)
        self._count(group.model, decision.reason)
        if not decision.remote:
            log.debug("rid=%s no remote prefill (%s): %d prompt tokens, %d cached on %s", ctx.rid,
                      decision.reason, tokens, cached, decoder.id)
            return decoder, body
        decoder.outstanding += 1  # the decoder's load while its prompt is prefilled elsewhere
        try:
            params = await self.params(ctx, group, target, payload, headers, total_deadline, route_payload)
        finally:
            decoder.outstanding -= 1
        return decoder, (body if params is None else decode_body(payload, params))

    def _count(self, model: str, reason: str) -> None:
        self.metrics.prefill_decisions.labels(model, reason).inc()

    async def params(self, ctx: RequestContext, group: ModelGroup, target: bytes, payload: dict[str, Any],
                     headers: bytes, total_deadline: float,
                     route_payload: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """The decoder's ``kv_transfer_params`` from a prefill endpoint; None: the decoder prefills."""
        pgroup = group.prefill
        assert pgroup is not None
        loop = asyncio.get_running_loop()
        by_cache = prefill_cache(cache_view(self.routing.scorer, group.model), route_payload)
        body = prefill_body(payload)
        tried: set[str] = set()
        started = time.monotonic()
        outcome = "fallback"
        try:
            for _ in range(TRIES):
                rt = self.routing.pick_prefill(pgroup, tried, by_cache)
                if rt is None:
                    outcome = "fallback" if tried else "unavailable"
                    return None
                tried.add(rt.id)
                by = "cache" if by_cache is not None and by_cache[0](rt) else "load"
                self.metrics.prefill_picks.labels(group.model, by).inc()
                deadline = min(loop.time() + self.s.prefill_timeout, total_deadline)
                rt.outstanding += 1
                try:
                    head, data = await request_whole(rt.get_pool(), target, headers, body, deadline)
                except Exception as e:  # noqa: BLE001 - classified; an unknown one (a bug) is raised again
                    failed = classify_exception(e, rt, "prefill timeout")
                    self.routing.record(rt, pgroup, failed.outcome, failure=failed.counts)
                    log.warning("rid=%s prefill on %s failed: %s", ctx.rid, rt.id, failed.error)
                    continue
                finally:
                    rt.outstanding -= 1
                if endpoint_fault(head.status):
                    failed = status_failure(head.status, data, rt, ctx.rid, head.headers.get("retry-after"))
                    self.routing.record(rt, pgroup, failed.outcome, failure=failed.counts)
                    continue
                if head.status >= 400:  # the client's request: the decoder will answer it the same
                    self.routing.record(rt, pgroup, "client_error", failure=False)
                    return None
                params, why = _params(head.status, data)
                if params is None:
                    # the engine answered, but nothing a decoder can use: its fault, not the client's
                    self.routing.record(rt, pgroup, "bad_prefill", failure=True)
                    log.warning("rid=%s prefill on %s: %s", ctx.rid, rt.id, why)
                    continue
                self.routing.record(rt, pgroup, "ok", failure=False)
                outcome = "ok"
                return params
            return None
        finally:
            self.metrics.prefill.labels(group.model, outcome).inc()
            self.metrics.prefill_seconds.labels(group.model).observe(time.monotonic() - started)


def _params(status: int, data: bytes) -> tuple[dict[str, Any] | None, str]:
    """The prefill answer's ``kv_transfer_params``, or None and why they cannot go to a decoder."""
    if status != 200:
        return None, f"HTTP {status}"
    try:
        params = json.loads(data).get("kv_transfer_params")
    except (ValueError, AttributeError):
        return None, "the answer is not a JSON object"
    problems = check_prefill_params(params)
    if problems:
        return None, "; ".join(problems)
    return params, ""
