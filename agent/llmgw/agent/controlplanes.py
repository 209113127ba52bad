"""Which control plane an agent dials, and which it obeys.

With several control planes (``ha``) one leads and the others refuse the
stream (503, the leader named in ``X-Llmgw-Leader``).  ``Addresses`` hands
the stream client the next URL after a connection that failed or was
refused, and prefers the leader a standby named when it is one of ours;
with one URL it always answers that URL, as before.

``LeaderFence`` remembers the highest leader term (``leader_epoch``) seen on
any message and refuses one that carries a lower term: a leader that was
paused past its lease and wakes still believing it leads must not be
obeyed.  Messages without a term (a control plane without ``ha``) pass.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger("llmgw.agent.stream")


class Addresses:
    """The control planes' stream URLs, in turn."""

    def __init__(self, urls: str | Sequence[str]):
        self.urls = (urls,) if isinstance(urls, str) else tuple(urls)
        if not self.urls:
            raise ValueError("no control-plane URL")
        self._i = 0

    @property
    def current(self) -> str:
        return self.urls[self._i]

    def next_after_failure(self, leader_hint: str | None = None) -> str:
        """The URL to dial after ``current`` failed: the named leader's when we know it, else the next."""
        if len(self.urls) > 1:
            hinted = self._matching(leader_hint) if leader_hint else None
            self._i = hinted if hinted is not None and hinted != self._i else (self._i + 1) % len(self.urls)
        return self.current

    def _matching(self, admin_url: str) -> int | None:
        """Our stream URL on the same host and port as a leader's admin URL."""
        want = urlsplit(admin_url)
        for i, u in enumerate(self.urls):
            got = urlsplit(u)
            if (got.hostname, got.port) == (want.hostname, want.port):
                return i
        return None


class DeposedLeader(Exception):
    """A message from a leader term lower than one already seen: the stream is dropped."""


def leader_hint(error: BaseException) -> str | None:
    """The leader a standby named when it refused the stream (``X-Llmgw-Leader``)."""
    headers = getattr(error, "headers", None)
    return headers.get("X-Llmgw-Leader") if headers is not None else None


class LeaderFence:
    """The highest leader term seen; a message from a lower one is refused."""

    def __init__(self) -> None:
        self.highest = 0

    def admit(self, msg: dict[str, Any]) -> None:
        """Remember ``msg``'s term; ``DeposedLeader`` when it is lower than one seen before."""
        term = msg.get("leader_epoch")
        if not isinstance(term, int):
            return
        if term < self.highest:
            raise DeposedLeader(f"refusing {msg.get('type')} from a deposed control-plane leader "
                                f"(term {term}; term {self.highest} leads now)")
        self.highest = term
