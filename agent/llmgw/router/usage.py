"""Reading what a request used from the engine's answer: ``usage`` of a whole body or of a stream.

Only requests of keys with a ``limits`` block and of cache-aware models
(``cachehits``: the engine's ``prompt_tokens_details.cached_tokens``) are
read here; every other answer is relayed as bytes, unparsed.  A stream's
usage arrives in its last event (``stream_options.include_usage``:
``"choices":[]`` and a ``usage`` object), which the router asks the engine
for on such a stream.
When the client did not ask for it, that event is cut out before the client
sees it (``StreamMeter(strip=True)``), so the client gets exactly the
stream it asked for.  A stream that ends without usage (the client left,
the engine broke) is charged one completion token per event relayed: the
engine sends one event per token it generates (the role-only first event
and ``[DONE]`` are counted too: at most two tokens over).
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

from .sse import EventBuffer, event_data


class Usage(NamedTuple):
    """What a request used (a tuple: made once per settled request, it must be cheap to build)."""

    prompt: int
    completion: int
    # ``prompt_tokens_details.cached_tokens``: the prompt tokens the engine found in its prefix
    # cache (vLLM with --enable-prompt-tokens-details); None when the answer does not say
    cached: int | None = None


def usage_of(obj: Any) -> Usage | None:
    """The ``usage`` of a decoded answer or stream event, when it is well formed."""
    if not isinstance(obj, dict):
        return None
    return _fields(obj.get("usage"))


def _fields(u: Any) -> Usage | None:
    if not isinstance(u, dict):
        return None
    prompt = u.get("prompt_tokens")
    completion = u.get("completion_tokens", 0)  # embeddings report none
    if not _count(prompt) or not _count(completion):
        return None
    details = u.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(prompt, completion, cached if _count(cached) else None)


_DECODER = json.JSONDecoder()

_N = rb"(0|[1-9][0-9]*)"
# vLLM's usage object as it serialises it (compact, in this order, details null or the cached tokens
# alone): read by one match in C instead of decoding; any other shape is decoded
_VLLM_USAGE = re.compile(rb'\{"prompt_tokens":' + _N + rb',"total_tokens":[0-9]+,"completion_tokens":' + _N +
                         rb',"prompt_tokens_details":(?:null|\{"cached_tokens":' + _N +
                         rb'\})(?:,"completion_tokens_details":null)?\}')


def body_usage(body: bytes) -> Usage | None:
    """The usage of a whole (non-streamed) JSON answer, or None.

    Only the ``usage`` object is read, found as the last ``"usage"`` followed
    by ``:`` and ``{`` (inside a JSON string a quote is escaped, so the marker is
    a key); anything else falls back to decoding the whole answer.  vLLM's own
    serialisation of the object is matched, not decoded: decoding it was the
    larger part of settling a one-token request of a limited key.
    """
    i = body.rfind(b'"usage"')
    if i < 0:
        return None
    j = body.find(b"{", i + 7)
    try:
        if j > 0 and body[i + 7:j].strip() == b":":
            m = _VLLM_USAGE.match(body, j)
            if m is not None:
                return Usage(int(m[1]), int(m[2]), None if m[3] is None else int(m[3]))
            return _fields(_DECODER.raw_decode(body[j:].decode("utf-8", "replace"))[0])
        return usage_of(json.loads(body))
    except (ValueError, RecursionError):
        return None


class StreamMeter:
    """Watches a relayed stream's complete events for usage; counts events for a stream cut short."""

    __slots__ = ("strip", "usage", "events")

    def __init__(self, strip: bool) -> None:
        self.strip = strip  # the router asked for include_usage, the client did not
        self.usage: Usage | None = None
        self.events = 0

    def see(self, data: bytes) -> bytes:
        """``data`` (complete events) as the client must get it: without the usage event when stripping.

        Per read: one count and one find, both in C; events are parsed only in
        the read that holds the usage event.
        """
        self.events += data.count(b"data:")
        if data.find(b'"usage":') < 0:
            return data
        kept = []
        for part in data.split(b"\n\n"):
            if b'"usage":' in part:
                payload = event_data(part)
                try:
                    obj = json.loads(payload) if payload else None
                except (ValueError, RecursionError):
                    obj = None
                u = usage_of(obj)
                if u is not None:
                    self.usage = u
                    if self.strip and obj.get("choices") == []:
                        continue
            kept.append(part)
        return b"\n\n".join(kept)

    def wrap(self, buf: EventBuffer) -> "MeteredBuffer":
        """``buf``'s pending bytes in a buffer whose releases pass through ``see``."""
        return MeteredBuffer(buf, self)

    def charged(self, prompt_estimate: int) -> Usage:
        """What to settle: the engine's usage, else the prompt estimate and one token per event relayed."""
        if self.usage is not None:
            return self.usage
        return Usage(prompt_estimate, max(0, self.events))


class MeteredBuffer(EventBuffer):
    """An ``EventBuffer`` whose releases a ``StreamMeter`` sees: what the relay (and its splice) use as ``buf``.

    The common release (whole events, nothing pending, no usage in them) costs one
    count and one find in this one call; the rest goes through ``StreamMeter.see``.
    """

    __slots__ = ("_meter",)

    def __init__(self, buf: EventBuffer, meter: StreamMeter) -> None:
        super().__init__()
        self._rest = buf.pending
        self._meter = meter

    def feed(self, chunk: bytes) -> bytes:
        if not self._rest and chunk[-2:] == b"\n\n":
            data = chunk
        else:
            data = EventBuffer.feed(self, chunk)
            if not data:
                return data
        if data.find(b'"usage":') >= 0:
            return self._meter.see(data)
        self._meter.events += data.count(b"data:")
        return data


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0
