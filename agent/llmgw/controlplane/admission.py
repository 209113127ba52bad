"""Admission control for agent streams: refuse what cannot be served, early and cheaply.

A registration costs the control plane far more than a heartbeat (a TLS
handshake, a 20 KB hardware document, a reconciler pass), and a control
plane that takes more of them than it can process starts missing the
heartbeats of agents already connected: they drop, dial again, and the load
feeds itself (a metastable failure).  So new streams are admitted at most at
``max_registrations_per_second`` (a token bucket with one second's burst);
the rest are refused before the WebSocket upgrade with HTTP 503 and a
``Retry-After`` sized to spread the agents refused of late over the
admission rate.  Agents wait that long, plus jitter, before they dial again.

A refusal after the TLS handshake still costs the handshake, the dearest
part of a registration: at half a core, 10,000 agents refused after their
handshakes and dialling back kept the control plane busy with handshakes
it then refused, and the fleet never converged.  So while the loop runs
behind, or ``BURST_FACTOR`` times the cap are under way (and for
``LOADED_HOLD`` seconds after either), TLS handshakes run at most
``max_tls_handshakes`` at once; a connection beyond waits, accepted and
unread, for one of them to end (``WAIT``: ``tlssite.HandshakeQueue``, newest
first, ten seconds at most).  While the loop runs later than
``max_loop_lag`` handshakes run at a trickle of the admission rate and a
connection beyond is dropped at accept, before its handshake (``DROP``), and
its agent backs off exponentially, with jitter.  A cap on handshakes at
once, not a rate: a control plane with less CPU finishes them more slowly
and so starts fewer, whatever rate is configured.  Waiting, not dropping,
below the lag: at 10,000 agents dialling at once, dropped dials came back on
their backoff in waves and the control plane sat idle between them, and
before the loop could read as behind 9,786 handshakes had begun together,
none finished for 29 s, and then 8,315 met the admission rate together and
were refused after paying for their handshakes.  Counting
at most a few handshakes from any one address, and none older than a couple
of seconds (``tlssite.HandshakesRunning``): a client holding handshakes open
without a word costs no CPU, and must not lock everyone else out.  A stream
whose handshake ran is not refused for the loop's lag (only for the rate):
that was judged before the handshake.  Where
the API has no TLS (no handshake to spare), the lag is judged at the upgrade.

Pure: every method takes ``now``.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from llmgw.controlplane.tokenbucket import TokenBucket

MAX_RETRY_AFTER = 60  # seconds: never tell an agent to stay away longer
# The cap on TLS handshakes at once (lifecycle.max_tls_handshakes) holds while the loop runs this late:
LOADED_LAG = 0.25
# ... and for this long after it last did: a loop that caught up for a moment must not start hundreds
# of handshakes at once (at half a core 288 were under way a second after the loop read on time).
LOADED_HOLD = 5.0
# While the loop runs later than max_loop_lag handshakes run at this share of the admission rate (at
# least one a second), a trickle that keeps the API answering an operator.
LAGGING_HANDSHAKE_SHARE = 0.05
# This many times the cap under way at once is load in itself: a fleet dialling at once is accepted in
# one go, before the loop has had a chance to read as behind.  Below it, and while the loop keeps
# time, the cap does not apply: handshakes waiting on slow agents cost no CPU (10,000 agents dialling
# at once: 66.0-68.8 s to every replica Ready with four times, 81.1-84.6 s with twice).
BURST_FACTOR = 4

# What ``handshake`` says of a connection just accepted.
RUN, WAIT, DROP = "run", "wait", "drop"


@dataclass
class Admission:
    admitted: int = 0
    refused: int = 0
    retry_after: int = 1  # the delay told last
    shed: int = 0  # connections dropped at accept, before their handshake
    _recent: deque = field(default_factory=deque)  # [second, refusals in it], the last MAX_RETRY_AFTER seconds
    _rate: TokenBucket | None = None  # streams admitted: max_registrations_per_second, one second's burst
    _trickle: TokenBucket | None = None  # handshakes while the loop lags; None while it keeps time
    _loaded_until: float = float("-inf")  # the cap on handshakes at once holds until then

    def decide(self, now: float, rate: float, lag: float, max_lag: float, *, handshake_paid: bool = False) -> int | None:
        """None: admit one stream now.  Otherwise the Retry-After (whole seconds) to answer with.

        ``handshake_paid``: the stream came through a TLS handshake that ``handshake`` let begin.  Its
        cost is sunk, and a refusal for the loop's lag would buy a second one when the agent dials
        back (at half a core, 10,000 agents: 22,183 such refusals, three in four handshakes the
        control plane did); the lag was judged before the handshake, only the rate is judged here."""
        burst = max(1.0, rate)
        if self._rate is None:
            self._rate = TokenBucket(burst, rate, burst, now)
        self._rate.capacity, self._rate.rate = burst, rate  # as configured now (a reload may change it)
        late = lag > max_lag and not handshake_paid
        if not late and self._rate.take(now):
            self.admitted += 1
            return None
        return self.refuse(now, rate, lag - max_lag if late else 0.0)

    def handshake(self, now: float, rate: float, lag: float, max_lag: float, in_flight: int,
                  cap: int) -> str:
        """What a connection just accepted gets, ``in_flight`` handshakes under way: ``RUN`` its TLS handshake
        now, ``WAIT`` (unread) for one under way to end, or ``DROP`` it now (counted in ``shed``)."""
        if lag >= LOADED_LAG or in_flight >= BURST_FACTOR * cap:
            self._loaded_until = now + LOADED_HOLD
        capped = in_flight >= cap and now < self._loaded_until
        if lag <= max_lag:
            self._trickle = None  # a fresh bucket, full, when the loop falls behind again
            return WAIT if capped else RUN
        allowed = max(1.0, rate * LAGGING_HANDSHAKE_SHARE)
        if self._trickle is None:
            self._trickle = TokenBucket(allowed, allowed, allowed, now)
        self._trickle.capacity = self._trickle.rate = allowed  # the rate as configured now (a reload may change it)
        if not capped and self._trickle.take(now):
            return RUN
        self.shed += 1
        return DROP

    def refuse(self, now: float, rate: float, behind: float = 0.0) -> int:
        """Count one refused stream and answer the Retry-After (whole seconds) that spreads the
        streams refused of late over ``rate`` (and waits out ``behind`` seconds of loop lag).

        A standby refuses every stream with it: the agents it turns away come back when the
        leader-to-be can admit them, not all in the second it takes over."""
        self.refused += 1
        second = int(now)
        if self._recent and self._recent[-1][0] == second:
            self._recent[-1][1] += 1
        else:
            self._recent.append([second, 1])
        while self._recent and self._recent[0][0] <= second - MAX_RETRY_AFTER:
            self._recent.popleft()
        # The agents refused within the last delay told will be back around
        # the same time: spread them over the admission rate.
        waiting = sum(n for s, n in self._recent if s > second - self.retry_after)
        delay = max(waiting / rate, behind)
        self.retry_after = max(1, min(MAX_RETRY_AFTER, math.ceil(delay)))
        return self.retry_after
