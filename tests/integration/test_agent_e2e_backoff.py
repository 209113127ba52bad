"""A fleet of real agents losing their control plane at once does not redial in lockstep.

Six ``llmgw agent`` processes register with ``llmgw server``; the server is
SIGKILLed, so every stream drops in the same instant, and a TLS listener of
this test takes its port.  The listener records when each connection
attempt arrives, completes the TLS handshake to learn which agent it is
(the node certificate's CN), and closes: to an agent that is a failed
attempt, so it backs off and tries again.  What is asserted are properties
of the distribution, never absolute times:

* the agents' k-th attempts are spread out, not bunched as a herd;
* each agent's gaps grow the way exponential backoff does;
* at any one step the agents' gaps differ (jitter), instead of all equalling
  the same ceiling.

Finally the real control plane returns on the same port and every agent
registers again: backing off never turns into giving up.
"""

from __future__ import annotations

import re
import socket
import ssl
import statistics
import threading
import time
from collections import defaultdict

import pytest
import yaml

from llmgw.tls import peer_identity, server_context

from fleet import WAIT, Fleet, until

pytestmark = pytest.mark.integration

AGENTS = 6
INITIAL, MAXIMUM = 0.5, 8.0  # delay ceilings per attempt: 0.5, 1, 2, 4, 8, 8, ...
ATTEMPTS = 6  # recorded per agent: five gaps each
# The agent's line for a dial that reached a listener which then hung up (not a refused connect).
FAILED = re.compile(r"WARNING llmgw\.agent\.stream: control plane wss://\S+: (?!ClientConnectorError)\w+")


class RecordingListener:
    """Accept on ``port``, note the time, learn the client's CN by a TLS handshake, close."""

    def __init__(self, port: int, ctx: ssl.SSLContext):
        self.ctx = ctx
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(64)
        self.attempts: dict[str, list[float]] = defaultdict(list)
        self.unknown: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            at = time.monotonic()
            t = threading.Thread(target=self._identify, args=(conn, at), daemon=True)
            t.start()
            self._threads.append(t)

    def _identify(self, conn: socket.socket, at: float) -> None:
        conn.settimeout(30)
        try:
            with self.ctx.wrap_socket(conn, server_side=True) as tls:
                name = peer_identity(tls).name
            with self._lock:
                self.attempts[name].append(at)
        except (OSError, ssl.SSLError, ValueError) as e:
            with self._lock:
                self.unknown.append(f"{type(e).__name__}: {e}")
        finally:
            conn.close()

    def snapshot(self) -> dict[str, list[float]]:
        with self._lock:
            return {k: sorted(v) for k, v in self.attempts.items()}

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        self._acceptor.join(WAIT)
        for t in self._threads:
            t.join(WAIT)


def test_agents_that_lose_their_control_plane_together_redial_with_jittered_growing_backoff(tmp_path):
    nodes = {f"n{i}": 1 for i in range(AGENTS)}
    with Fleet(tmp_path, nodes=nodes, replicas=0, lifecycle={"unreachable_after": 60, "lost_after": 120}) as f:
        f.config["deployments"] = []
        f.write_config()
        for name in nodes:
            path = tmp_path / name / "agent.yaml"
            doc = yaml.safe_load(path.read_text())
            doc["control_plane"].update(reconnect_initial=INITIAL, reconnect_max=MAXIMUM)
            path.write_text(yaml.safe_dump(doc))
        f.start()
        until(lambda: (doc := f.try_get("/v1/nodes")) and sum(n["connected"] for n in doc["nodes"]) == AGENTS,
              "every agent registered", on_timeout=f.dump)

        ctx = server_context(f.pki.ca_cert, *f.pki.server)
        f.server.kill()  # every stream drops in the same instant
        dropped = time.monotonic()
        listener = RecordingListener(f.port, ctx)
        try:
            want = set(f.node_ids.values())
            until(lambda: (s := listener.snapshot()).keys() == want and all(len(v) >= ATTEMPTS for v in s.values()),
                  f"{ATTEMPTS} attempts from each of the {AGENTS} agents",
                  on_timeout=lambda: f"{listener.snapshot()}\nunknown: {listener.unknown}\n{f.dump()}")
        finally:
            listener.close()
        seen = listener.snapshot()
        assert set(seen) == want, f"attempts from something that is not one of the agents: {set(seen) - want}"

        # One dial per attempt: the listener saw no more connections from an agent than that agent
        # logged failed attempts (a hidden immediate re-dial under each attempt doubles the herd).
        agent_of = {node_id: f.agents[name] for name, node_id in f.node_ids.items()}

        def failed_attempts(node_id: str) -> int:
            return len(FAILED.findall(agent_of[node_id].output(10**7)))

        until(lambda: all(len(seen[n]) <= failed_attempts(n) for n in want),
              "each agent to have logged every attempt the listener saw, once", timeout=30,
              on_timeout=lambda: "\n".join(f"{n}: listener saw {len(seen[n])}, agent logged {failed_attempts(n)}"
                                           for n in sorted(want)))

        times = {n: [t - dropped for t in v[:ATTEMPTS]] for n, v in seen.items()}
        gaps = {n: [b - a for a, b in zip(v, v[1:])] for n, v in times.items()}
        report = "\n".join(f"{n}: attempts at {[round(t, 3) for t in times[n]]}" for n in sorted(times))

        # Not a herd: at every step the agents' attempts are spread over a good part of a second or more.
        # (Without jitter they would all land within a few milliseconds of each other.)
        for k in range(1, ATTEMPTS):
            kth = [v[k] for v in times.values()]
            assert max(kth) - min(kth) >= 0.2, f"attempt #{k} of every agent came together\n{report}"
        close_pairs = sum(1 for k in range(ATTEMPTS) for a in times.values() for b in times.values()
                          if a is not b and abs(a[k] - b[k]) < 0.005) // 2
        assert close_pairs <= AGENTS, f"{close_pairs} same-step attempts within 5 ms of another agent's\n{report}"

        # Backoff: gaps grow.  Pooled over the agents, late gaps are several times the early ones.
        early = [g[i] for g in gaps.values() for i in (0, 1)]
        late = [g[i] for g in gaps.values() for i in (3, 4)]
        assert statistics.mean(late) > 2 * statistics.mean(early), report

        # Jitter: at one and the same step the agents wait different times, not all the same ceiling.
        for i in (2, 3, 4):
            step = [g[i] for g in gaps.values()]
            assert max(step) - min(step) >= 0.3, f"gap #{i} is the same for every agent: {step}\n{report}"

        # The control plane returns on the same port: every agent registers again.
        f.server.start()
        f.wait_healthy()
        until(lambda: (doc := f.try_get("/v1/nodes")) and sum(n["connected"] for n in doc["nodes"]) == AGENTS,
              "every agent registered with the returned control plane", on_timeout=f.dump)
        assert all(a.alive() and a.lives == 1 for a in f.agents.values())
        assert f.server.alive()
