"""A request's token ids, for cache-aware routing: the engine simulator's, or the model's own tokenizer.

Route keys are digests of token ids, so the router must tokenize a prompt exactly as the engine
does, or no key it computes will ever match. The engine simulator's tokenizer is deterministic
and cheap (``llmgw.sim.sim_tokens``: whitespace-separated words, a chat rendered one message per
line as ``role: content``; ``llmgw.sim.sim_kvcache.token_ids``), so it runs inline, capped at
``max_tokens``. A real engine's needs the model repository's ``tokenizer.json`` and chat template
(``tokenize_model``), run off the event loop (``tokenize_pool``): ``model_scorers`` builds one
``CacheAware`` per model listed in ``cache_aware.model_tokenizers``, sharing one pool, counting
the requests whose ids did not come in time, and checked against the engines' ``/tokenize``
(``tokenize_parity``).
"""

from __future__ import annotations

from typing import Any


def simulator_token_ids(payload: dict[str, Any] | None, max_tokens: int) -> list[int]:
    """The first ``max_tokens`` token ids the engine simulator makes of this request; [] when none."""
    from llmgw.sim.sim_kvcache import token_ids
    from llmgw.sim.sim_tokens import PromptError, chat_prompt_tokens, completion_prompts

    if not payload:
        return []
    try:
        if "messages" in payload:
            words = chat_prompt_tokens(payload["messages"])
        elif "prompt" in payload:
            words = completion_prompts(payload["prompt"])[0]  # a batch: the first prompt decides
        else:
            return []
    except (PromptError, TypeError, ValueError, IndexError):
        return []
    return token_ids([str(w) for w in words[:max_tokens]])


def model_scorers(ca: Any, index: Any, fallback: Any, registry: Any = None) -> dict[str, Any]:
    """A ``CacheAware`` per model of ``ca.model_tokenizers`` (its tokenizer loaded now: a router
    that cannot load one fails to start, naming it), all sharing one ``TokenizePool``."""
    from prometheus_client import CollectorRegistry, Counter

    from .balancing import CacheAware
    from .tokenize_model import ModelTokenizer
    from .tokenize_pool import TokenizePool

    pool = TokenizePool(ca.tokenize_threads, ca.tokenize_deadline)
    fallbacks = Counter("llmgw_router_tokenize_fallbacks_total",
                        "Requests of a cache-aware model routed by prefix affinity because the router "
                        "could not tokenize them in time (reason: timeout, busy, error)",
                        ["model", "reason"], registry=registry if registry is not None else CollectorRegistry())
    out = {}
    for model, directory in ca.model_tokenizers.items():
        out[model] = CacheAware(index, None, ca.block_size, ca.max_prompt_tokens, fallback,
                                model_tokenizer=ModelTokenizer.from_directory(directory), pool=pool,
                                on_fallback=lambda reason, m=model: fallbacks.labels(m, reason).inc())
    return out
