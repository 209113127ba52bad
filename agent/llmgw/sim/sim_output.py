"""What a request's completion says, as vLLM would shape it: stop strings, n choices, tool calls.

Pure functions over the request body and the simulator's token texts (``tok0 tok1
...``), so the HTTP handlers only splice the result into vLLM's JSON and SSE frames.

* ``stop``: vLLM checks its stop strings after every token, in the order given, and
  cuts the text where the first match starts; the stop string itself is not returned
  (no ``include_stop_str_in_output``), ``finish_reason`` is ``"stop"`` and
  ``stop_reason`` the matched string. The tokens generated up to the match count in
  ``usage``. Streaming holds the text back the same way, so the streamed deltas join
  to the same text.
* ``tool_choice`` naming a function, or ``"required"``: refused (400) unless the engine
  runs with ``--tool-call-parser``, as vLLM 0.32 refuses them; with one, vLLM constrains
  decoding to a call of that (the first) tool, so the message is ``content: ""`` with one
  ``tool_calls`` entry whose ``arguments`` satisfy the function's parameter schema;
  ``finish_reason`` is ``"stop"`` for a named function and ``"tool_calls"`` for
  ``"required"`` (serving_chat.py). ``"auto"`` is refused with vLLM's message: the
  simulator does not choose between text and a call.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from llmgw.sim.sim_tokens import token_text


class BadRequest(ValueError):
    """A request vLLM refuses with 400; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Output:
    pieces: tuple[str, ...]  # one text per streamed chunk; joined, the choice's text
    tokens: int  # completion tokens generated (usage), including those a stop string consumed
    finish_reason: str
    stop_reason: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def stop_strings(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,) if stop else ()
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(s for s in stop if s)
    raise BadRequest("stop must be a string or a list of strings", "stop")


def choices_count(body: dict[str, Any]) -> int:
    n = body.get("n", 1)
    if n is None:
        return 1
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise BadRequest(f"n must be at least 1, got {n}.")  # vLLM names no param here
    return n


def generate(tokens: int, finish_reason: str, stops: tuple[str, ...]) -> Output:
    """``tokens`` token texts, cut at the first stop string the way vLLM's stop checker cuts."""
    text = ""
    pieces: list[str] = []
    for i in range(tokens):
        piece = token_text(i)
        before = len(text)
        text += piece
        for s in stops:
            # Only a match that ends in the new token can be new; vLLM looks back len(s) - 1.
            at = text.find(s, max(0, before - len(s) + 1))
            if at != -1:
                return Output(_cut([*pieces, piece], at), i + 1, "stop", s)
        pieces.append(piece)
    return Output(tuple(pieces), tokens, finish_reason)


def _cut(pieces: list[str], length: int) -> tuple[str, ...]:
    """``pieces`` holding only the first ``length`` characters (a match may start in an earlier piece:
    vLLM holds back what could begin a stop string, so it was never streamed)."""
    out, used = [], 0
    for p in pieces:
        if used + len(p) >= length:
            out.append(p[:length - used])
            break
        out.append(p)
        used += len(p)
    return tuple(p for p in out if p) or ("",)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    finish_reason: str

    def message_entry(self) -> dict[str, Any]:
        return {"id": f"chatcmpl-tool-{os.urandom(16).hex()}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def tool_call(body: dict[str, Any], parser: str | None) -> ToolCall | None:
    """The forced tool call of a chat request, None when it generates text; BadRequest as vLLM refuses.
    ``parser``: the engine's ``--tool-call-parser``, without which vLLM forces no call."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if choice is None and tools:
        choice = "auto"
    if choice is None or choice == "none":
        return None
    if not isinstance(tools, list):
        raise BadRequest("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice == "auto":
        raise BadRequest('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
    functions = [t.get("function") for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)]
    if choice == "required":
        if not functions:
            return None  # vLLM treats "required" with no tools as "none", as OpenAI does
        if parser is None:
            raise BadRequest('tool_choice="required" requires --tool-call-parser to be set')
        return ToolCall(str(functions[0].get("name")), _arguments(functions[0].get("parameters")), "tool_calls")
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str) or not name:
        raise BadRequest(f"Invalid value for `tool_choice`: {choice}! Only named tools, \"none\", \"auto\" "
                         "or \"required\" are supported.", "tool_choice")
    if parser is None:
        raise BadRequest(f'tool_choice=function "{name}" requires --tool-call-parser to be set')
    for f in functions:
        if f.get("name") == name:
            return ToolCall(name, _arguments(f.get("parameters")), "stop")
    raise BadRequest("The tool specified in `tool_choice` does not match any of the specified `tools`",
                     "tool_choice")


def _arguments(schema: Any) -> str:
    return json.dumps(_value(schema if isinstance(schema, dict) else {}), separators=(", ", ": "))


def _value(schema: dict[str, Any]) -> Any:
    """The smallest value guided decoding could produce for ``schema``: required fields only."""
    if "enum" in schema and schema["enum"]:
        return schema["enum"][0]
    kind = schema.get("type", "object")
    if isinstance(kind, list):
        kind = kind[0] if kind else "object"
    if kind == "object":
        props = schema.get("properties") or {}
        return {k: _value(props.get(k) or {}) for k in schema.get("required") or () if isinstance(k, str)}
    return {"string": "tok0", "integer": 0, "number": 0, "boolean": False, "array": [], "null": None}.get(kind, None)


# The log-probabilities the simulator reports: fixed values, the sampled token the likeliest.
SAMPLED_LOGPROB = -0.5
OTHER_LOGPROB = -2.5


def logprobs_requested(body: dict[str, Any], chat: bool) -> int | None:
    """How many alternatives a request's log-probabilities list per token; None when it asks for none."""
    if chat:
        if not body.get("logprobs"):
            return None
        top = body.get("top_logprobs") or 0
    else:
        top = body.get("logprobs")
        if top is None or isinstance(top, bool):
            return None
    if not isinstance(top, int) or top < 0:
        raise BadRequest(f"logprobs must be a non-negative integer, got {top}.", "logprobs")
    return top


def _alternatives(piece: str, top: int) -> list[tuple[str, float]]:
    """The sampled token first, then ``top - 1`` others (vLLM lists the sampled one among the top)."""
    if top < 1:
        return []
    return [(piece, SAMPLED_LOGPROB)] + [(f"{piece}~{j}", OTHER_LOGPROB - j) for j in range(1, top)]


def chat_logprobs(pieces: tuple[str, ...] | list[str], top: int) -> dict[str, Any]:
    """A chat choice's ``logprobs``, as vLLM's ChatCompletionLogProbs."""
    def entry(token: str, lp: float) -> dict[str, Any]:
        return {"token": token, "logprob": lp, "bytes": list(token.encode())}

    return {"content": [{**entry(p, SAMPLED_LOGPROB), "top_logprobs": [entry(t, lp) for t, lp in _alternatives(p, top)]}
                        for p in pieces]}


def completion_logprobs(pieces: tuple[str, ...] | list[str], top: int, at: int = 0) -> dict[str, Any]:
    """A completion choice's ``logprobs``, as vLLM's (OpenAI's legacy) CompletionLogProbs; ``at``:
    the first piece's offset in the choice's text (a streamed chunk carries one piece)."""
    offsets = []
    for p in pieces:
        offsets.append(at)
        at += len(p)
    return {"text_offset": offsets, "token_logprobs": [SAMPLED_LOGPROB] * len(pieces), "tokens": list(pieces),
            "top_logprobs": [dict(_alternatives(p, max(top, 1))) for p in pieces]}
