"""``/v1/agent/stream``: one authenticated WebSocket per node.

Identity before anything else: the TLS handshake has verified the client
certificate against the fleet CA; here its role must be ``node`` (an admin
or role-less certificate is refused before the upgrade) and, once the
``register`` arrives, its CN must equal the node id claimed, byte for byte.
Every refusal is logged with its reason and the peer address.

Every message is checked (``messages.parse_up``) before it is used; the
first bad one closes that agent's stream and nothing else.

Keepalive is the agents' business: each pings every ``keepalive_interval``
and gives the control plane ``stream_grace`` to answer, both told in
``liveness`` (right after ``registered``), so a control plane that pauses for less than the grace
costs no stream.  The control plane sends no pings of its own (its
heartbeat is the agents'); it answers theirs and notes every frame, and a
stream silent (not even a ping) for ``keepalive_interval + stream_grace``
while its node is unreachable is taken for half-open and closed
(``ControlPlane.tick``).

A heartbeat stands in for the ping: ``answers_heartbeats`` (after
``accepts``) promises that while heartbeats arrive, a frame goes back at
least every ``keepalive_interval`` (an unsolicited pong, RFC 6455 5.5.3,
when nothing else went out), so an agent that knows the message pings
only when it sent no heartbeat for a ping interval.  A ping is a frame to
read and a pong to write; in a steady fleet it was a third of the frames
the control plane read.  Agents that predate the message ignore it and
ping as before; their pings are answered as before.

Before the upgrade, admission control (``admission``) refuses new streams
the control plane cannot serve now with 503 and a ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from datetime import datetime, timezone
from typing import Any

from aiohttp import WSCloseCode, WSMsgType, web

from llmgw import compat
from llmgw.controlplane.admission import DROP, WAIT, Admission
from llmgw.controlplane.gpuclaims import GpuOwners
from llmgw.controlplane.lifecycle import NodeState
from llmgw.controlplane.messages import MessageProblem, dumps, parse_up
from llmgw.controlplane.revocation import checked_identity
from llmgw.controlplane.state import ControlPlane
from llmgw.protocol import MAX_MESSAGE
from llmgw.tls import IdentityError, PeerIdentity, check_node_identity

log = logging.getLogger("llmgw.controlplane.agents")

REGISTER_TIMEOUT = 30.0  # seconds an upgraded stream may stay silent before its register
POLICY_VIOLATION = 1008  # WebSocket close code for refused identity / invalid message
SEND_QUEUE = 1024  # messages buffered per stream before the stream counts as stuck
PONG = {"type": "pong"}  # queued for the writer: an unsolicited WebSocket pong, not a message
# Optional shard_status / shard_report fields this control plane takes, announced in ``accepts``.
ACCEPTED_SHARD_FIELDS = ("engine_version", "sleeping", "side_port")


class StreamSession:
    """Outbound half of one stream: ordered sends through a queue and one writer task."""

    def __init__(self, ws: web.WebSocketResponse, node_id: str, peer: str | None):
        self.ws = ws
        self.node_id = node_id
        self.peer = peer
        self.epoch = 0
        self.queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(maxsize=SEND_QUEUE)
        self.closing: str | None = None
        self.close_code: int = WSCloseCode.GOING_AWAY
        self.last_word = time.monotonic()  # when a frame last went to the agent (a message or a pong)
        self.answer_every: float | None = None  # with answers_heartbeats: the keepalive_interval it was told
        self.writer = asyncio.get_running_loop().create_task(self._write(), name=f"stream writer {node_id}")

    def send(self, msg: dict[str, Any]) -> bool:
        if self.closing is not None:
            return False
        try:
            self.queue.put_nowait(msg)
        except asyncio.QueueFull:
            self.close("send queue full: the agent is not reading")
            return False
        return True

    def heartbeat(self) -> None:
        """A heartbeat came: a pong goes back if nothing went to the agent for its keepalive interval."""
        if self.answer_every is not None and time.monotonic() - self.last_word >= self.answer_every:
            self.last_word = time.monotonic()  # not twice for heartbeats arriving before the writer runs
            self.send(PONG)

    def close(self, reason: str, level: int = logging.INFO, code: int = WSCloseCode.GOING_AWAY) -> None:
        if self.closing is None:
            self.closing, self.close_code = reason, code
            log.log(level, "closing stream of %s (epoch %d): %s", self.node_id, self.epoch, reason)
            with contextlib.suppress(asyncio.QueueFull):
                self.queue.put_nowait(None)
            if self.queue.full():
                asyncio.get_running_loop().create_task(self.ws.close(code=code))

    async def _write(self) -> None:
        try:
            while True:
                msg = await self.queue.get()
                if msg is None:
                    break
                if msg is PONG:
                    await self.ws.pong()
                else:
                    await self.ws.send_str(dumps(msg))
                self.last_word = time.monotonic()
        except (ConnectionError, RuntimeError) as e:
            log.info("stream of %s: send failed: %s", self.node_id, e)
        finally:
            if self.closing is not None and not self.ws.closed:
                await self.ws.close(code=self.close_code, message=self.closing[:120].encode())

    async def stop(self) -> None:
        self.writer.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.writer


def _peer(request: web.Request) -> str:
    peer = request.transport.get_extra_info("peername") if request.transport else None
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(request.remote)


def request_identity(request: web.Request) -> PeerIdentity:
    """The verified client certificate's identity, or ``IdentityError`` (none presented, unparsable,
    or ``RevokedError``: on the revocation list)."""
    return checked_identity(request)


def _close_at_expiry(session: StreamSession, identity: PeerIdentity) -> asyncio.TimerHandle:
    """Close the stream when the certificate it was opened with expires.

    TLS checks validity only at the handshake, so without this a connection
    made a minute before expiry would serve for as long as it stays up; the
    agent's next handshake, with the expired certificate, is refused.
    """
    loop = asyncio.get_running_loop()
    left = (identity.not_after - datetime.now(timezone.utc)).total_seconds()
    return loop.call_later(max(0.0, left), session.close,
                           f"its client certificate expired at {identity.not_after:%Y-%m-%d %H:%M:%S} UTC",
                           logging.WARNING, POLICY_VIOLATION)


class AgentService:
    def __init__(self, cp: ControlPlane, require_identity: bool = True):
        self.cp = cp
        self.require_identity = require_identity
        self.gpus = GpuOwners()
        self.admission = Admission()
        # Handlers of upgraded streams whose register has not come yet: ended at shutdown, so
        # that a silent (or slow) agent does not hold the process for REGISTER_TIMEOUT.
        self._unregistered: set[asyncio.Task[Any]] = set()

    async def shutdown(self, _app: web.Application | None = None) -> None:
        """End the streams still waiting for their register (``app.on_shutdown``).

        The registered ones are closed by the server with a reason; these have
        none to hear it, and aiohttp would otherwise wait out their handlers.
        """
        for task in list(self._unregistered):
            task.cancel()

    def _gpu_problem(self, node_id: str, hardware: dict[str, Any]) -> str | None:
        """Another live node's GPU UUIDs in ``hardware`` (``gpuclaims``); records them when there are none."""
        def holds(other: str) -> bool:
            rec = self.cp.nodes.get(other)
            return rec is not None and rec.clock.state is not NodeState.LOST

        problem = self.gpus.problem(node_id, hardware, holds)
        if problem is None:
            self.gpus.record(node_id, hardware)
        return problem

    def shed_handshake(self, running: int) -> str:
        """What a connection just accepted gets, with ``running`` TLS handshakes under way (``Admission.handshake``):
        RUN its handshake, WAIT for one to end, or DROP it; the agents dropped back off and dial again."""
        lc, behind = self.cp.settings.lifecycle, self.cp.looplag.behind()
        verdict = self.admission.handshake(self.cp.clock(), lc.max_registrations_per_second, behind, lc.max_loop_lag,
                                           running, lc.max_tls_handshakes)
        if verdict == WAIT:
            self.cp.arriving("waiting")  # an agent, most likely: it holds the startup grace
        elif verdict == DROP:
            self._dropped(f"{running} handshakes under way, loop {behind:.1f}s behind")
        return verdict

    def handshake_waited_out(self) -> None:
        """A connection that waited for a handshake was dropped: waited too long, or pushed out by newer ones."""
        self.admission.shed += 1
        self._dropped("waited too long for a handshake")

    def _dropped(self, why: str) -> None:
        self.cp.arriving("shed")  # most likely an agent dialling back: it holds the startup grace
        if self.admission.shed % 1000 == 1:  # a storm would otherwise log a line per connection
            log.warning("admission: dropping new connections before their TLS handshake (%s; %d dropped so far, "
                        "%d refused after a handshake, %d admitted)", why, self.admission.shed,
                        self.admission.refused, self.admission.admitted)

    def _shed(self, peer: str, secure: bool) -> web.Response | None:
        """Refuse a new stream the control plane cannot serve now (see ``admission``); None: go on."""
        if self.cp.stopping:
            return web.json_response({"error": "the control plane is stopping"}, status=503,
                                     headers={"Retry-After": "1"})
        lc = self.cp.settings.lifecycle
        retry = self.admission.decide(self.cp.clock(), lc.max_registrations_per_second, self.cp.looplag.behind(),
                                      lc.max_loop_lag, handshake_paid=secure)
        if retry is None:
            self.cp.arriving("admitted")
            return None
        self.cp.timers.note_refused(self.cp.clock(), retry, lc)
        self.cp.dials["refused"] += 1
        if self.admission.refused % 100 == 1:  # a storm would otherwise log a line per refusal
            log.warning("admission: refusing new agent streams for now (from %s; %d refused so far, %d admitted): "
                        "retry after %ds", peer, self.admission.refused, self.admission.admitted, retry)
        return web.json_response({"error": "the control plane is admitting no more agent streams just now",
                                  "retry_after_s": retry}, status=503, headers={"Retry-After": str(retry)})

    def _registered(self, session: StreamSession, epoch: int) -> None:
        """``registered`` (the epoch, the heartbeat interval), then ``liveness``: the pings asked for, the grace given.

        ``liveness`` is a message of its own: an agent that predates it
        ignores it (with a warning) and keeps its registration, where an
        unknown field in ``registered`` would make it refuse the message.
        ``accepts`` follows, for the same reason.
        """
        lc = self.cp.lifecycle()
        session.send({"type": "registered", "epoch": epoch, "heartbeat_interval": lc.heartbeat_interval,
                      **self.cp.leader_fields()})
        session.send({"type": "liveness", "keepalive_interval": lc.keepalive_interval,
                      "stream_grace": lc.stream_grace})
        # Optional fields this control plane takes in shard_status: an agent newer than the
        # control plane (agents upgrade first) sends none a control plane has not named here.
        session.send({"type": "accepts", "shard_status": list(ACCEPTED_SHARD_FIELDS)})
        # kv_routes likewise: an agent sends its route keys only after this (an unknown type closes a stream)
        session.send(self.cp.route_keys.accepted_message())
        # heartbeats stand in for pings from here (agents that do not know the message keep pinging)
        session.answer_every = lc.keepalive_interval
        session.send({"type": "answers_heartbeats"})

    async def _keepalive(self, session: StreamSession, raw: Any, epoch: int) -> None:
        """A ping or pong: the stream is alive (not a heartbeat: the node's silence is judged on those)."""
        self.cp.frame(session.node_id, epoch)
        if raw.type == WSMsgType.PING:
            with contextlib.suppress(ConnectionError, RuntimeError):
                await session.ws.pong(raw.data)
                session.last_word = time.monotonic()

    async def _refuse(self, ws: web.WebSocketResponse, peer: str, reason: str, claimed: str | None) -> web.WebSocketResponse:
        log.warning("refused agent stream from %s%s: %s", peer, f" claiming {claimed!r}" if claimed else "", reason)
        with contextlib.suppress(Exception):
            await ws.send_str(dumps({"type": "error", "reason": reason}))
            await ws.close(code=POLICY_VIOLATION, message=reason[:120].encode())
        return ws

    async def handle(self, request: web.Request) -> web.StreamResponse:
        peer = _peer(request)
        identity: PeerIdentity | None = None
        if self.require_identity:
            try:
                identity = request_identity(request)
                if identity.role != "node":
                    check_node_identity(identity, identity.name)  # raises with the role's reason
            except IdentityError as e:
                log.warning("refused agent stream from %s: %s", peer, e.reason)
                return web.json_response({"error": e.reason}, status=403)

        shed = self._shed(peer, request.secure)
        if shed is not None:
            return shed
        ws = web.WebSocketResponse(max_msg_size=MAX_MESSAGE, autoping=False)
        await ws.prepare(request)
        me = asyncio.current_task()
        if me is not None:
            self._unregistered.add(me)
        try:
            first = await ws.receive(timeout=REGISTER_TIMEOUT)
            while first.type in (WSMsgType.PING, WSMsgType.PONG):  # an agent pinging before its register
                if first.type == WSMsgType.PING:
                    await ws.pong(first.data)
                first = await ws.receive(timeout=REGISTER_TIMEOUT)
        except asyncio.TimeoutError:
            return await self._refuse(ws, peer, f"no register within {REGISTER_TIMEOUT:g}s", None)
        finally:
            self._unregistered.discard(me)  # type: ignore[arg-type]
        if first.type != WSMsgType.TEXT:
            return await self._refuse(ws, peer, f"expected a register text frame, got {first.type.name}", None)
        try:
            msg = parse_up(first.data)
        except MessageProblem as e:
            return await self._refuse(ws, peer, str(e), None)
        if msg["type"] != "register":
            return await self._refuse(ws, peer, f"first message must be register, got {msg['type']}", None)
        node_id = msg["node_id"]
        if identity is not None:
            try:
                check_node_identity(identity, node_id)
            except IdentityError as e:
                return await self._refuse(ws, peer, e.reason, node_id)
        gpu_problem = self._gpu_problem(node_id, msg["hardware"])
        if gpu_problem is not None:
            return await self._refuse(ws, peer, gpu_problem, node_id)

        session = StreamSession(ws, node_id, peer)
        epoch = self.cp.register(msg, session, peer, certificate=None if identity is None else {
            "serial": identity.serial_hex, "not_after": identity.not_after.isoformat(),
            "fingerprint_sha256": identity.fingerprint_sha256})
        # No await between register and this send: "registered" is the first
        # thing on the stream, ahead of any start/stop the reconciler queues.
        self._registered(session, epoch)
        if self.cp.stopping:  # upgraded before the stop, registered after it: not kept open past the stop
            session.close("control plane shutting down")
        # This coroutine lives as long as the stream: names still bound here
        # would keep the register document (text and decoded, about 20 KB for
        # an 8-GPU node) and the latest message alive for every node. The
        # control plane keeps what it needs in its own records.
        del first, msg
        expiry = None if identity is None else _close_at_expiry(session, identity)
        reason = "closed by the agent"
        try:
            async for raw in ws:
                if raw.type == WSMsgType.ERROR:
                    # aiohttp has already closed the stream (1009 for an oversized frame).
                    reason = f"stream error: {ws.exception()}"
                    log.warning("closed stream of %s (epoch %d): %s", node_id, epoch, reason)
                    break
                if raw.type in (WSMsgType.PING, WSMsgType.PONG):
                    await self._keepalive(session, raw, epoch)
                    continue
                try:
                    m = parse_up(raw.data if raw.type == WSMsgType.TEXT else bytes(raw.data or b""))
                    if m["type"] == "register":
                        raise MessageProblem("register may be sent only once per connection")
                    if m["type"] == "hardware" and m["hardware"].get("node_id") != node_id:
                        raise MessageProblem(f"hardware: node_id {m['hardware'].get('node_id')!r} is not this "
                                             f"stream's node {node_id!r}")
                    if m["type"] == "hardware" and (gpu_problem := self._gpu_problem(node_id, m["hardware"])):
                        log.error("refused hardware from %s: %s", node_id, gpu_problem)
                        raise MessageProblem(f"hardware: {gpu_problem}")
                except MessageProblem as e:
                    reason = str(e)
                    session.send({"type": "error", "reason": reason[:4096]})
                    session.close(reason, level=logging.WARNING, code=POLICY_VIOLATION)
                    break
                if not self.cp.message(node_id, epoch, m):
                    reason = "superseded"
                    break
                if m["type"] == "heartbeat":
                    session.heartbeat()
                del raw, m  # not held while waiting for the next message (see above)
            else:
                if ws.close_code is not None:
                    reason = f"closed with code {ws.close_code}"
        finally:
            if expiry is not None:
                expiry.cancel()
            self.cp.disconnected(node_id, epoch)
            try:
                if session.closing is not None:
                    # Let the writer flush the error message and close.
                    with contextlib.suppress(Exception):  # the timeout included; a cancellation goes on
                        await compat.wait_for(asyncio.shield(session.writer), timeout=2.0)
            finally:
                await session.stop()
            if not ws.closed:
                await ws.close()
            log.info("stream of %s (epoch %d) ended: %s", node_id, epoch, reason)
        return ws
