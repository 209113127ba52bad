"""What each API key and source address holds of the router now, and which cap a request would cross.

Pure bookkeeping, no I/O: ``admission`` reads bodies and answers, this
decides.  A request takes its place (one request, and its declared body
size) when it is admitted; a body of no declared size (chunked) then
``grow``s its holding as its bytes arrive, so a small chunked body costs
what it sent, not ``limits.max_body_bytes``.  Each ``take`` and ``grow`` is
given back exactly once, by whoever made it, when the request ends.

A refusal names its cap (``Refusal.klass``, the ``clients`` setting that
refused it): that is the class it is counted under in
``llmgw_router_errors_total``, so an operator sees which cap refuses and
raises that one.  The class set is fixed (four caps): no key or address
ever becomes a label.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Caps:
    """0 disables a cap."""

    requests_per_key: int = 512
    requests_per_source: int = 1024
    body_bytes_per_key: int = 64 * 1024 * 1024
    body_bytes_per_source: int = 64 * 1024 * 1024
    retry_after: int = 1


@dataclass(frozen=True)
class Refusal:
    """A cap a request would cross: whose (``who``: key or source), of what, and its value."""

    who: str  # "key" or "source"
    what: str  # "requests" or "body_bytes"
    cap: int

    @property
    def klass(self) -> str:
        """The errors_total class: the name of the ``clients`` setting that refused it."""
        return f"max_{self.what}_per_{self.who}"

    @property
    def reason(self) -> str:
        """What is over the cap, for the client's message and the log."""
        if self.what == "requests":
            return f"{self.cap} requests in flight"
        return f"{self.cap} bytes of request bodies in flight"


class Held:
    """What one key or source holds now: requests and reserved body bytes."""

    __slots__ = ("requests", "bytes")

    def __init__(self) -> None:
        self.requests = 0
        self.bytes = 0


class Holdings:
    """Per-key and per-source holdings against ``Caps``; an entry exists while it holds a request."""

    def __init__(self, caps: Caps) -> None:
        self.caps = caps
        self.by_key: dict[str, Held] = {}
        self.by_source: dict[str, Held] = {}
        # built once: a refusal is a constant, not an allocation per request
        self._requests = (Refusal("source", "requests", caps.requests_per_source),
                          Refusal("key", "requests", caps.requests_per_key))
        self._bytes = (Refusal("source", "body_bytes", caps.body_bytes_per_source),
                       Refusal("key", "body_bytes", caps.body_bytes_per_key))

    def check(self, source: str, key: str | None, n: int) -> Refusal | None:
        """The cap a new request of ``n`` body bytes would cross (the source's first), else None."""
        caps = self.caps
        held = self.by_source.get(source)
        if held is not None:
            if caps.requests_per_source and held.requests + 1 > caps.requests_per_source:
                return self._requests[0]
            if caps.body_bytes_per_source and n and held.bytes + n > caps.body_bytes_per_source:
                return self._bytes[0]
        if key is not None:
            held = self.by_key.get(key)
            if held is not None:
                if caps.requests_per_key and held.requests + 1 > caps.requests_per_key:
                    return self._requests[1]
                if caps.body_bytes_per_key and n and held.bytes + n > caps.body_bytes_per_key:
                    return self._bytes[1]
        return None

    @staticmethod
    def take(table: dict[str, Held], name: str, n: int) -> Held:
        """One request of ``n`` reserved bytes for ``name``; give it back with ``give``."""
        held = table.get(name)
        if held is None:
            held = table[name] = Held()
        held.requests += 1
        held.bytes += n
        return held

    @staticmethod
    def give(table: dict[str, Held], name: str, held: Held, n: int) -> None:
        """Undo a ``take`` of ``n`` bytes (and whatever ``grow`` added must be given back before)."""
        held.requests -= 1
        held.bytes -= n
        if held.requests <= 0:
            table.pop(name, None)

    def grow(self, source: Held, key: Held | None, n: int) -> Refusal | None:
        """Reserve ``n`` more body bytes for a request already taken, unless that crosses a byte cap.

        Nothing is reserved on a refusal. Give the bytes back with ``shrink``.
        """
        caps = self.caps
        if caps.body_bytes_per_source and source.bytes + n > caps.body_bytes_per_source:
            return self._bytes[0]
        if key is not None and caps.body_bytes_per_key and key.bytes + n > caps.body_bytes_per_key:
            return self._bytes[1]
        source.bytes += n
        if key is not None:
            key.bytes += n
        return None

    @staticmethod
    def shrink(source: Held, key: Held | None, n: int) -> None:
        """Give back ``n`` bytes that ``grow`` reserved."""
        source.bytes -= n
        if key is not None:
            key.bytes -= n
