"""A request's token ids, for cache-aware routing: only the engine simulator's, so far.

Route keys are digests of token ids, so the router must tokenize a prompt exactly as the engine
does, or no key it computes will ever match. The engine simulator's tokenizer is deterministic
and cheap (``llmgw.sim.sim_tokens``: whitespace-separated words, a chat rendered one message per
line as ``role: content``; ``llmgw.sim.sim_kvcache.token_ids``), so it runs inline, capped at
``max_tokens``. A real engine's needs the model repository's ``tokenizer.json`` and chat template
off the event loop, which the router does not do yet: ``tokenizer: simulator`` is the only
setting, and documented as such.
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
