"""Which engine signals go upstream after a read: only what moved beyond its dead band, and a refresh.

The control plane needs a replica's queue depth or KV-cache use only to the
precision its rule acts on, so the agent sends a value again only when it has
moved more than the dead band the control plane gave with it (the deployment's
``tolerance`` x ``target``: a sum of errors that small cannot move the count
past the rule's own dead band), or when it became unreadable (``None``) or
readable again.  Everything it holds is sent again once every ``refresh``
seconds: the control plane counts a value only while it is that fresh, so an
agent that stopped reading is told from one whose engines are steady.

Pure: times come in, nothing is sent from here (``agent/enginesignals`` sends).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Reading:
    value: float | None  # None: the engine's page did not show the signal (or did not answer)
    deadband: float


class Deadband:
    def __init__(self) -> None:
        self.sent: dict[str, float | None] = {}  # shard id -> the value last sent
        self.refreshed_at: float | None = None  # when everything was last sent

    def due(self, now: float, read: Mapping[str, Reading], refresh: float) -> dict[str, float | None]:
        """The values to send now (shard id -> value), marked as sent; empty: nothing to send.

        A shard read for the first time is sent once it shows a value (a replica still
        starting shows none, and the control plane does not count it yet).
        """
        for sid in [s for s in self.sent if s not in read]:
            del self.sent[sid]  # no longer asked for
        if self.refreshed_at is None or now - self.refreshed_at >= refresh:
            out = {sid: r.value for sid, r in read.items() if r.value is not None or sid in self.sent}
            if out:
                self.refreshed_at = now
        else:
            out = {}
            for sid, r in read.items():
                if sid not in self.sent:
                    if r.value is not None:
                        out[sid] = r.value
                    continue
                last = self.sent[sid]
                if (last is None) != (r.value is None) or (
                        last is not None and r.value is not None and abs(r.value - last) > r.deadband):
                    out[sid] = r.value
        self.sent.update(out)
        return out
