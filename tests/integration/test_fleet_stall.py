"""A control plane that pauses or is starved of CPU costs no stream, and sheds what it cannot serve.

Simulated agents (``llmgw-fleet-sim``, the agent's own stream client over
mutual TLS) against a real ``llmgw server``:

- stall: the control plane is stopped (SIGSTOP) for 10 s and then for 30 s,
  as a long GC pass or VM steal would stop it.  No agent may drop its
  stream, no node may go unreachable, no replica may move: the agents give
  the control plane the grace it advertised, and the control plane does not
  count its own pause against the agents' heartbeats.
- contention: the control plane held to a fraction of one CPU
  (``llmgw.sim.fleet.throttle``) while a fleet dials it cold, with an
  admission rate below what the fleet asks for: the excess is refused with
  503 and Retry-After, the agents come back when told, and every node ends
  up registered once.
- dials that arrive while the control plane is behind are dropped at accept,
  before their TLS handshake (the dearest part of a refusal), and the agents
  back off and come back; a fleet dialling at once waits for its handshakes,
  none dropped.

Everything asserted is a count, read from the control plane's API and log
and from the simulator's status file; nothing here measures speed.
"""

from __future__ import annotations

import signal
import socket
import ssl
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

from fleet import FAST_LIFECYCLE, Fleet, metric_samples, until
from llmgw.sim.fleet.throttle import Throttle
from fleet_sim import Sim, assert_no_gpu_twice, nodes_doc, placement
from tests.support.procfs import tcp_clients_of

pytestmark = pytest.mark.integration

NODES = 24
REPLICAS = 12
WAIT = 120.0
# Short heartbeats, so the 30 s stall exceeds unreachable_after and lost_after; keepalive_interval and
# stream_grace are the defaults (pings every 10 s). max_loop_lag is 1 s, a third of the default, so the
# pauses of two or three seconds these tests make put the loop past it.
LIFECYCLE = {"heartbeat_interval": 1.0, "keepalive_interval": 10.0, "unreachable_after": 15.0, "lost_after": 20.0,
             "startup_grace": 2.0, "max_unreachable_share": 0.55, "replacements_per_minute": 600,
             "stream_grace": 60.0, "max_loop_lag": 1.0}


@contextmanager
def sim_fleet(tmp_path: Path, nodes: int, replicas: int, lifecycle: dict[str, Any]) -> Iterator[tuple[Fleet, Sim]]:
    """A control plane with no agents of its own, and a simulator of ``nodes`` agents not yet started."""
    with Fleet(tmp_path, nodes={}, replicas=replicas, lifecycle=lifecycle) as f:
        f.start(agents=False)
        sim = Sim(f, tmp_path, nodes=nodes, engines=0)
        f.extra.append(sim.proc)
        try:
            yield f, sim
        finally:
            sim.close()


def ready(f: Fleet, sim: Sim, nodes: int, replicas: int) -> dict[str, Any]:
    def settled() -> dict[str, Any] | None:
        st = sim.status()
        if not st or st["registered"] != nodes:
            return None
        doc = nodes_doc(f)
        if doc is None or len(doc["nodes"]) != nodes or any(n["state"] != "ready" for n in doc["nodes"]):
            return None
        reps = f.try_get("/v1/replicas")
        if reps is None or len(reps["replicas"]) != replicas or any(r["state"] != "ready" for r in reps["replicas"]):
            return None
        return reps

    return until(settled, "every node registered and every replica ready", WAIT, interval=0.5,
                 on_timeout=lambda: f"{sim.status()}\n--- server ---\n{f.server.output(6000)}")


class HandshakeAcrossThePause:
    """An admin client connected before the control plane stops, its TLS handshake (and the
    control plane's handshake deadline, head_timeout: 15 s) begun: it sends its ClientHello
    during the pause and asks for ``/healthz`` once the handshake completes."""

    def __init__(self, f: Fleet) -> None:
        self.raw = socket.create_connection(("127.0.0.1", f.port), timeout=WAIT)
        time.sleep(0.5)  # accepted: the control plane has begun the handshake and armed its deadline
        self.ctx = ssl.create_default_context(cafile=str(f.pki.ca_cert))
        self.ctx.load_cert_chain(*map(str, f.pki.admin))
        self.result: list[object] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            with self.ctx.wrap_socket(self.raw, server_hostname="127.0.0.1") as tls:
                tls.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                self.result.append(int(tls.recv(4096).split(b" ", 2)[1]))
        except OSError as e:
            self.result.append(e)

    def start(self) -> None:
        self.thread.start()

    def answer(self) -> object:
        self.thread.join(WAIT)
        return self.result[0] if self.result else "no answer"


@pytest.fixture(scope="module")
def stalled_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, Sim]]:
    root = tmp_path_factory.mktemp("stall")
    f = Fleet(root, nodes={}, replicas=REPLICAS, lifecycle=LIFECYCLE)
    sim = Sim(f, root, nodes=NODES, engines=0)
    f.extra.append(sim.proc)
    try:
        f.start(agents=False)
        sim.proc.start()
        yield f, sim
    finally:
        sim.close()
        f.close()


@pytest.mark.parametrize("pause", [10.0, 30.0])
def test_a_control_plane_pause_costs_no_stream(stalled_fleet: tuple[Fleet, Sim], pause: float) -> None:
    f, sim = stalled_fleet
    before = placement(ready(f, sim, NODES, REPLICAS))
    regs = sim.status()["registrations"]
    cp_regs = {n["node_id"]: n["registrations"] for n in nodes_doc(f)["nodes"]}
    log_from = len(f.server.life_output())

    handshake = HandshakeAcrossThePause(f)
    f.server.signal(signal.SIGSTOP)
    try:
        handshake.start()  # its ClientHello waits in the socket while the control plane is stopped
        time.sleep(pause)
    finally:
        f.server.signal(signal.SIGCONT)
    assert handshake.answer() == 200, "a TLS handshake begun before the pause was aborted by it"

    # Back: every node heard from since the pause (its heartbeats read), and a lifecycle pass made after that.
    def caught_up() -> bool:
        doc = nodes_doc(f)
        return doc is not None and all(n["last_seen_s"] < 2 * LIFECYCLE["heartbeat_interval"] for n in doc["nodes"])

    until(caught_up, "every node heard from after the pause", WAIT, interval=0.5, on_timeout=lambda: f.server.output(6000))
    time.sleep(2 * LIFECYCLE["heartbeat_interval"])  # room for a wrong transition or a dropped stream to show
    logged = f.server.life_output()[log_from:]
    st = sim.status()
    assert st["registrations"] == regs and st["registered"] == NODES, "an agent dropped its stream and registered again"
    assert "stream closed" not in logged, "an agent's stream was closed by the pause"
    assert " -> unreachable " not in logged, "a node was judged unreachable for the control plane's own pause"
    doc = nodes_doc(f)
    assert {n["node_id"]: n["registrations"] for n in doc["nodes"]} == cp_regs
    assert all(n["state"] == "ready" and n["connected"] for n in doc["nodes"])
    after = f.replicas()
    assert placement(after) == before, "a replica moved or restarted"
    assert_no_gpu_twice(after)
    assert "stalled for" in logged, "the control plane did not notice its own pause"


def test_a_starved_control_plane_admits_what_it_can_and_every_node_registers_once(tmp_path: Path) -> None:
    nodes, replicas = 40, 8
    lifecycle = {**LIFECYCLE, "max_registrations_per_second": 5.0}
    with Fleet(tmp_path, nodes={}, replicas=replicas, lifecycle=lifecycle) as f:
        f.start(agents=False)
        throttle = Throttle(f.server.pid, share=0.3, period=0.1).start()
        sim = Sim(f, tmp_path, nodes=nodes, engines=0)
        f.extra.append(sim.proc)
        try:
            sim.proc.start()
            ready(f, sim, nodes, replicas)
            st = sim.status()
            logged = f.server.life_output()
        finally:
            throttle.stop()
            sim.close()
        assert throttle.cycles > 0
        # admission control refused some dials, and the agents waited as told instead of churning
        assert st["refusals"] > 0, st
        assert st["registrations"] == nodes, f"registrations per node: {st['registrations_per_node']}"
        assert st["registrations_per_node"] == {"1": nodes}
        assert {n["registrations"] for n in nodes_doc(f)["nodes"]} == {1}
        assert "admission: refusing new agent streams" in logged
        assert "stream closed" not in logged


def test_dials_that_arrive_while_the_control_plane_is_behind_are_dropped_before_their_handshake(tmp_path: Path) -> None:
    """A fleet dials a stopped control plane: on waking its loop is seconds behind and admits
    nothing, so a handshake with any of the agents waiting in its backlog would be spent on a
    refusal. They are dropped at accept instead (at half a core, 10,000 agents refused after
    their handshakes and dialling back kept the control plane from ever converging), and every
    agent backs off, comes back and registers once."""
    nodes, replicas = 30, 6
    # while the loop lags, handshakes run at 5 % of the admission rate: one a second here
    lifecycle = {**LIFECYCLE, "max_registrations_per_second": 20.0}
    with sim_fleet(tmp_path, nodes, replicas, lifecycle) as (f, sim):
        f.server.signal(signal.SIGSTOP)
        try:
            sim.proc.start()  # every agent's dial waits in the stopped control plane's backlog
            # the kernel completes their TCP handshakes; the TLS ones wait for the control plane
            until(lambda: len([ip for ip in tcp_clients_of(f.port) if ip.startswith("127.1.")]) >= nodes,
                  "every agent's dial in the backlog", WAIT, interval=0.2)
            time.sleep(2.0)
        finally:
            f.server.signal(signal.SIGCONT)
        ready(f, sim, nodes, replicas)
        st = sim.status()
        logged = f.server.life_output()
        assert "admission: dropping new connections before their TLS handshake" in logged
        assert st["connect_errors"] > 0, st  # dropped: the agents saw their dials fail, not a 503
        assert st["registrations_per_node"] == {"1": nodes}, st
        assert {n["registrations"] for n in nodes_doc(f)["nodes"]} == {1}
        assert "stream closed" not in logged


def test_a_fleet_dialling_at_once_waits_for_its_handshakes_and_none_is_dropped(tmp_path: Path) -> None:
    """A fleet dials at once, before the control plane's loop can read as behind: beyond four times
    max_tls_handshakes under way the burst is load in itself, and each connection past the cap waits,
    accepted and unread, for a handshake to end. None is dropped, so no agent sees its dial fail and
    backs off (at 10,000 agents, the dials dropped came back on their backoff in waves and the control
    plane sat idle between them), and every agent registers once."""
    nodes, replicas = 40, 8
    lifecycle = {**LIFECYCLE, "max_tls_handshakes": 2}
    with sim_fleet(tmp_path, nodes, replicas, lifecycle) as (f, sim):
        sim.proc.start()
        ready(f, sim, nodes, replicas)
        st = sim.status()
        dials = {labels["outcome"]: v for labels, v in metric_samples(f)["llmgw_agent_dials_total"]}
        logged = f.server.life_output()
    assert dials["shed"] == 0 and st["connect_errors"] == 0, (dials, st)  # none dropped
    assert dials["waiting"] > 0, dials  # the burst was held at the cap
    assert dials["registered"] == nodes, dials
    assert st["registrations_per_node"] == {"1": nodes}, st
    assert "stream closed" not in logged


def test_a_stream_whose_handshake_ran_is_not_refused_for_a_pause_that_came_after(tmp_path: Path) -> None:
    """An agent's TLS handshake completes, then the control plane stops and the agent's upgrade
    request waits for it: on waking the loop is seconds behind. The handshake is paid; a refusal
    would only buy a second one when the agent dials back (at half a core, 10,000 agents: three
    handshakes in four were spent on such refusals), so the stream is admitted."""
    with Fleet(tmp_path, nodes={}, replicas=1, lifecycle=LIFECYCLE) as f:
        f.start(agents=False)
        ctx = ssl.create_default_context(cafile=str(f.pki.ca_cert))
        ctx.load_cert_chain(*map(str, f.pki.node("late-upgrade")))
        with socket.create_connection(("127.0.0.1", f.port), timeout=WAIT) as raw, \
                ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            time.sleep(0.5)  # the control plane has read the client's Finished: its handshake is done
            f.server.signal(signal.SIGSTOP)
            try:
                tls.sendall(b"GET /v1/agent/stream HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                            b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                            b"Sec-WebSocket-Version: 13\r\n\r\n")
                time.sleep(3.0)  # three times max_loop_lag
            finally:
                f.server.signal(signal.SIGCONT)
            head = tls.recv(4096)
        until(lambda: "stalled for" in f.server.life_output(), "the control plane to notice its pause", WAIT)
        assert head.split(b" ", 2)[1] == b"101", head  # before: 503 and a Retry-After


def test_an_idle_stream_lives_on_the_pings_the_control_plane_asks_for(tmp_path: Path) -> None:
    """The agent's own keepalive_interval is 10 s; the control plane asks for a ping every 1 s and gives
    2 s of grace: the agent must ping at the interval it was told from then on, or its stream, idle but
    for heartbeats, is dropped every 3 s."""
    with Fleet(tmp_path, nodes={"a": 1}, replicas=1) as f:
        f.start()
        f.wait_ready(1)
        agent = f.agents["a"]
        time.sleep(4 * (FAST_LIFECYCLE["keepalive_interval"] + FAST_LIFECYCLE["stream_grace"]))
        assert "nothing from the control plane" not in agent.life_output()
        assert "stream closed" not in agent.life_output()
        assert f.nodes()[f.node_ids["a"]]["registrations"] == 1


@dataclass
class Restarted:
    before: dict[str, Any]  # placement before the restart
    after: dict[str, Any]  # the replicas once every node is back
    first: str  # the first control plane's log
    logged: str  # the restarted one's
    status: dict[str, Any]  # the simulator's status at the end


def restart_a_simulated_fleet(f: Fleet, tmp_path: Path, nodes: int, replicas: int,
                              extra: tuple[str, ...] = ()) -> Restarted:
    """A simulated fleet brought up on ``f``, its control plane SIGKILLed and started again, and the
    fleet back: what each life of the control plane saw."""
    f.start(agents=False)
    sim = Sim(f, tmp_path, nodes=nodes, engines=0, extra=extra)
    f.extra.append(sim.proc)
    try:
        sim.proc.start()
        before = placement(ready(f, sim, nodes, replicas))
        first = f.server.life_output()
        f.server.kill()
        f.server.start()
        after = ready(f, sim, nodes, replicas)
        return Restarted(before, after, first, f.server.life_output(), sim.status())
    finally:
        sim.close()


def test_a_restart_that_admits_its_fleet_slowly_holds_its_grace_and_moves_nothing(tmp_path: Path) -> None:
    """After a restart the control plane admits agents at its own rate; the startup grace holds while
    those it refused are due back. With a fixed grace, the replicas of agents still waiting in line
    were placed again on the nodes already back, and the late agents' engines then stopped as
    surplus: a 5,000-node storm on a loaded host restarted 2,190 replicas that way."""
    nodes, replicas = 24, 12
    lifecycle = {**LIFECYCLE, "startup_grace": 5.0, "max_registrations_per_second": 4.0}
    with Fleet(tmp_path, nodes={}, replicas=replicas, lifecycle=lifecycle) as f:
        r = restart_a_simulated_fleet(f, tmp_path, nodes, replicas)
        assert r.status["refusals"] > 0, "the restart admitted every agent at once: nothing was tested"
        assert "admission: refusing new agent streams" in r.logged
        assert placement(r.after) == r.before, "a replica moved or restarted across the restart"
        assert_no_gpu_twice(r.after)


def test_a_restart_whose_agents_come_back_over_their_backoff_holds_its_grace_and_moves_nothing(tmp_path: Path) -> None:
    """After a restart the agents come back as their reconnect backoff spreads them, some well past
    startup_grace. No admission refusal holds the grace, so with a grace held only by refusals it
    ended while agents were still on their way (in backoff, or turned away at the per-source cap)
    and their replicas were placed again on the nodes already back: a 10,000-node storm on half a
    core re-placed 5,062 of 21,600 that way. Paced by the agents' backoff, not by CPU: each redial
    is drawn from [0, 8 s], so the fleet is back about 8 s after the restart on any host, after the
    4 s grace and within MAX_GRACE_FACTOR x 4 s."""
    nodes, replicas = 200, 100
    # admission never refuses here (no rate or loop-lag refusal to hold the grace)
    lifecycle = {**LIFECYCLE, "startup_grace": 4.0, "max_registrations_per_second": 100000.0, "max_loop_lag": 600.0}
    # a whole node per replica: half the fleet holds one, so any of them late after the grace shows
    with Fleet(tmp_path, nodes={}, replicas=replicas, lifecycle=lifecycle, profile={"tensor_parallel_size": 8}) as f:
        r = restart_a_simulated_fleet(f, tmp_path, nodes, replicas, ("--reconnect-initial", "8", "--reconnect-max", "8"))
        # the first control plane on its store placed nothing before it: it waited startup_grace alone
        assert "the first control plane on this store: startup_grace alone" in r.first
        after, before = placement(r.after), r.before
        anew = sorted(set(after) - set(before))
        assert after == before, (f"{len(anew)} replica(s) placed anew across the restart, "
                                 f"{sum(a != after.get(rep) for rep, a in before.items())} "
                                 f"of {replicas} moved or restarted")
        assert_no_gpu_twice(r.after)
        assert r.status["registrations_per_node"] == {"2": nodes}, "every node came back, once"
        assert {n["registrations"] for n in nodes_doc(f)["nodes"]} == {1}
        assert "admission: refusing" not in r.logged
        assert "startup grace held past startup_grace" in r.logged, \
            "every agent was back within the grace: nothing was tested"
