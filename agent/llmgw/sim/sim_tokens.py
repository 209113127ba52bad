"""Tokens in and out of the simulator: deterministic, countable, checkable.

Prompt tokens are whitespace-separated words.  A chat prompt is its messages
rendered one per line as ``role: content`` (a stand-in for a chat template:
the same conversation always gives the same tokens, and the role is part of
them).  A completions prompt given as token ids uses the ids themselves.

Output token ``i`` (0-based) is the text ``tok<i>``, preceded by a space for
``i > 0``, so a whole completion reads ``tok0 tok1 tok2 ...``.  A client can
therefore check that no token was lost, duplicated or reordered on the way
(e.g. through a router) by comparing the words with ``tok0..tok<n-1>``.
"""

from __future__ import annotations

from typing import Any


class PromptError(ValueError):
    """A prompt the OpenAI API would refuse (wrong type, missing field)."""


def token_text(i: int) -> str:
    return f"tok{i}" if i == 0 else f" tok{i}"


def expected_text(n: int) -> str:
    """The full text of an n-token completion."""
    return "".join(token_text(i) for i in range(n))


class TokenBytes:
    """Output token texts, pre-encoded once: the streaming hot path only concatenates.

    The texts contain no character JSON would escape, so they are spliced into
    chunk templates as they are.
    """

    def __init__(self) -> None:
        self._cache: list[bytes] = []

    def first(self, n: int) -> list[bytes]:
        while len(self._cache) < n:
            self._cache.append(token_text(len(self._cache)).encode())
        return self._cache[:n]


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                raise PromptError(f"{where}[{j}] must be an object")
            if part.get("type") == "text":
                parts.append(str(part.get("text", "")))
        return " ".join(parts)
    raise PromptError(f"{where} must be a string or a list of content parts")


def chat_prompt_tokens(messages: Any) -> list[str]:
    if not isinstance(messages, list) or not messages:
        raise PromptError("messages must be a non-empty list")
    lines = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise PromptError(f"messages[{i}] must be an object with a string role")
        lines.append(f"{msg['role']}: {_content_text(msg.get('content'), f'messages[{i}].content')}")
    return "\n".join(lines).split()


def completion_prompts(prompt: Any) -> list[list[str]]:
    """The prompts of a completions request: str, [str], [int] or [[int]]."""
    if prompt is None or prompt == "" or (isinstance(prompt, list) and any(p in ("", []) for p in prompt)):
        raise PromptError("Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)")
    if isinstance(prompt, str):
        return [prompt.split()]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [p.split() for p in prompt]
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [[str(t) for t in prompt]]
        if all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
            return [[str(t) for t in p] for p in prompt]
    raise PromptError("prompt must be a string, a list of strings, or token ids")


def embedding_inputs(value: Any) -> list[str]:
    """Inputs of an embeddings request, each as the text that is hashed."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return list(value)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return [" ".join(str(t) for t in value)]
        if all(isinstance(v, list) and all(isinstance(t, int) for t in v) for v in value):
            return [" ".join(str(t) for t in v) for v in value]
    raise PromptError("input must be a string, a list of strings, or token ids")
