"""The agent's end of the stream: dial out, register, heartbeat, obey.

GPU nodes sit behind firewalls far more often than control planes do, so the
agent dials out (``wss://.../v1/agent/stream``, mutual TLS) and keeps one
connection.  It reconnects forever with full-jitter backoff, and nothing that
happens to the connection ever stops an engine: the router talks to engines
directly, so a control plane that is away costs no traffic.

Each connection starts with a ``register`` carrying the node's freshly
discovered hardware and every shard the agent runs, built at the instant the
connection is up.  Status messages produced while disconnected are dropped
rather than queued: a replay of stale transitions after the fact could only
contradict the register, which already says what is true now.

Incoming messages are validated against the stream schema; an invalid one is
logged and ignored (it is the control plane's bug, and dropping the link over
it would only make the node look unreachable).

Liveness: the agent pings every ``keepalive_interval`` and drops the stream
only when nothing at all (a message, a pong) has come for that interval plus
``stream_grace``, both as the control plane says in ``liveness``, right
after ``registered`` (the agent's own ``keepalive_interval`` and
``DEFAULT_GRACE`` until then, and with a control plane that predates it).  The
grace is longer than the pauses a control plane can have (a GC pass, VM
steal): a fixed pong deadline of a few seconds would turn each such pause
into a fleet-wide reconnection storm.  A control plane that sends
``answers_heartbeats`` sends a frame back at least every keepalive interval
while heartbeats arrive, so the heartbeat stands in for the ping: the agent
pings only when no heartbeat went out for a ping interval (heartbeats held
back, a heartbeat interval longer than the ping's).  That spares the control
plane a frame to read and a pong to write per ping interval and node.

Admission: a control plane that answers the upgrade with 503 and
``Retry-After`` is obeyed, with jitter (``Backoff.told``), instead of the
usual backoff.  So is a standby (``X-Llmgw-Role: standby``), after which the
agent dials the leader it names or its next address; a standby's answer also
resets the backoff, since a control plane that answers is not a dead one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from typing import Any, Awaitable, Callable, Sequence

import aiohttp

from llmgw import __version__, compat
from llmgw.agent import procident
from llmgw.agent.backoff import Backoff
from llmgw.agent.controlplanes import Addresses, DeposedLeader, LeaderFence, leader_hint
from llmgw.agent.enginesignals import EngineSignals
from llmgw.agent.enginesleep import EngineSleep
from llmgw.agent.schema import definition_problems
from llmgw.agent.supervisor import Supervisor
from llmgw.hardware.types import HardwareInventory
from llmgw.protocol import MAX_MESSAGE

log = logging.getLogger(__name__)

DEFAULT_GRACE = 60.0  # seconds past a ping an agent waits for a word before ``registered`` says otherwise
MAX_RETRY_AFTER = 300.0  # the longest Retry-After obeyed (a server's mistake must not park a node for hours)
DOWN_TYPES = ("registered", "liveness", "accepts", "answers_heartbeats", "kv_routes_accepted",
              "engine_signals_wanted", "start", "stop", "drain", "sleep", "wake", "error")

Discover = Callable[[], Awaitable[HardwareInventory]]


def incoming_problems(msg: Any) -> list[str]:
    """Why ``msg`` is not a valid control-plane -> agent message (empty when it is)."""
    if not isinstance(msg, dict):
        return [f"not a JSON object: {type(msg).__name__}"]
    kind = msg.get("type")
    if kind not in DOWN_TYPES:
        return [f"type {kind!r} is not sent to agents (expected one of {', '.join(DOWN_TYPES)})"]
    return definition_problems(kind, msg)


def stream_session(connect_timeout: float = 15.0, connector: aiohttp.BaseConnector | None = None
                   ) -> aiohttp.ClientSession:
    """The HTTP session an agent's stream dials through (no total timeout, no silent redial)."""
    timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout, sock_connect=connect_timeout)
    session = aiohttp.ClientSession(timeout=timeout, connector=connector)
    # aiohttp redials a GET once, at once, when the server drops or resets the
    # connection before answering: a second, unjittered dial on the heels of
    # every attempt, just when a control plane (or its load balancer) is
    # shedding load.  The backoff in ``StreamClient`` is the only retry
    # policy; there is no public switch for this in aiohttp 3.x.
    if hasattr(session, "_retry_connection"):
        session._retry_connection = False
    return session


class StreamClient:
    """One agent's connection loop.  ``send`` is safe to call at any time."""

    def __init__(self, *, url: str | Sequence[str], node_id: str, address: str, ssl_context: ssl.SSLContext | None,
                 supervisor: Supervisor, discover: Discover, reconnect_initial: float,
                 reconnect_max: float, keepalive: float = 10.0, connect_timeout: float = 15.0,
                 rediscover: float = 0.0):
        self.addresses = Addresses(url)  # several control planes (ha): the next after a failure
        self.url = self.addresses.current
        self.fence = LeaderFence()  # the highest leader term seen; a lower one is refused
        self.node_id = node_id
        self.address = address
        self.ssl_context = ssl_context
        self.supervisor = supervisor
        self.engine_sleep = EngineSleep(supervisor)  # the control plane's sleep and wake of engines
        self.engine_signals = EngineSignals(supervisor, self.send)  # queue depth, KV use: only when asked
        self.discover = discover
        self.backoff = Backoff(reconnect_initial, reconnect_max)
        self.keepalive = keepalive
        self.connect_timeout = connect_timeout
        self.rediscover = rediscover  # seconds between rediscoveries while connected; 0: never
        self.epoch: int | None = None
        self.grace = DEFAULT_GRACE  # seconds past a ping to wait for a word (``registered`` says)
        self.refusals = 0  # upgrades refused with 503 (admission control), for logs and tests
        self.connections = 0  # successful WebSocket upgrades, for logs and tests
        self.ws: aiohttp.ClientWebSocketResponse | None = None  # the live stream's WebSocket, if any
        self._queue: asyncio.Queue[dict[str, Any]] | None = None
        self._commands: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------------- hooks
    # Called at these points of every connection; nothing by default.  They are
    # how the fleet simulator counts and injects faults into the agent's own
    # client without reaching into it.
    def on_dial_end(self, error: BaseException | None, upgraded: bool) -> None:
        """One dial ended: ``error`` is why (None: the stream closed), ``upgraded`` whether its WebSocket was up."""

    async def before_register(self) -> None:
        """Awaited on a fresh connection before its first message (the ``register``) is sent."""

    def on_registered(self) -> None:
        """The control plane answered the ``register`` with ``registered``."""

    def on_kv_routes_accepted(self, msg: dict[str, Any]) -> None:
        """The control plane on this stream takes ``kv_routes`` within ``msg``'s bounds (the KV relay's cue)."""

    @property
    def connected(self) -> bool:
        """Whether a stream is up (what ``send`` queues now goes out)."""
        return self._queue is not None

    # ----------------------------------------------------------------- sending
    def send(self, msg: dict[str, Any]) -> None:
        """Queue ``msg`` on the live connection; drop it when there is none (see module doc)."""
        q = self._queue
        if q is None:
            log.debug("not connected; dropping %s (the next register carries the current state)", msg.get("type"))
            return
        q.put_nowait(msg)

    def register_message(self, hw: HardwareInventory) -> dict[str, Any]:
        return {
            "type": "register",
            "node_id": self.node_id,
            "agent_version": __version__,
            "boot_id": procident.boot_id(),
            "address": self.address,
            "hardware": hw.to_dict(),
            "shards": self.supervisor.reports(),
        }

    # ----------------------------------------------------------------- the loop
    async def run_forever(self, session: aiohttp.ClientSession | None = None) -> None:
        """Connect, and reconnect, forever.

        ``session`` (made by ``stream_session``) lets many clients in one
        process share one connection pool; by default the client owns its own.
        """
        if session is None:
            async with stream_session(self.connect_timeout) as own:
                await self._run(own)
        else:
            await self._run(session)

    async def _run(self, session: aiohttp.ClientSession) -> None:
        while True:
            try:
                await self._connect_once(session)
            except asyncio.CancelledError:
                raise
            except aiohttp.WSServerHandshakeError as e:
                told, hint = self._retry_after(e), leader_hint(e)
                standby = e.headers is not None and e.headers.get("X-Llmgw-Role") == "standby"
                if standby:
                    # A control plane that is up answered (a leader is at most a lease away): come back
                    # when it says, to the leader it names or the next address, without the growth
                    # that dead addresses earn, which would leave the agent asleep for up to
                    # reconnect_max after the takeover.
                    was, self.url = self.url, self.addresses.next_after_failure(hint)
                    self.backoff.reset()
                    delay = self.backoff.told(told) if told is not None else self.backoff.next_delay()
                    log.info("control plane %s is a standby (leader: %s); dialling %s in %.2fs",
                             was, hint or "not known yet", self.url, delay)
                    await asyncio.sleep(delay)
                    continue
                if told is not None:  # shed by the leader: the same address, later
                    self.refusals += 1
                    delay = self.backoff.told(told)
                    log.info("control plane %s is admitting no more streams just now; dialling again in %.2fs "
                             "(Retry-After %gs); engines keep running", self.url, delay, told)
                    await asyncio.sleep(delay)
                    continue
                log.warning("control plane %s: %s: %s", self.url, type(e).__name__, e)
                self.url = self.addresses.next_after_failure(hint)
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ssl.SSLError, DeposedLeader) as e:
                log.warning("control plane %s: %s: %s", self.url, type(e).__name__, e)
                self.url = self.addresses.next_after_failure(leader_hint(e))
            except Exception:
                log.exception("stream to %s failed", self.url)
            delay = self.backoff.next_delay()
            log.info("reconnecting to %s in %.2fs (attempt %d); engines keep running",
                     self.url, delay, self.backoff.attempt)
            await asyncio.sleep(delay)

    @staticmethod
    def _retry_after(e: aiohttp.WSServerHandshakeError) -> float | None:
        """The seconds a 503 refusal asked us to wait (None: not such a refusal)."""
        if e.status != 503 or e.headers is None:
            return None
        try:
            told = float(e.headers.get("Retry-After", ""))
        except ValueError:  # an HTTP date, or garbage: the usual backoff
            return None
        return min(MAX_RETRY_AFTER, told) if told > 0 else None

    async def _connect_once(self, session: aiohttp.ClientSession) -> None:
        before, error = self.connections, None
        try:
            await self._stream(session)
        except BaseException as e:
            error = e
            raise
        finally:
            self.ws = None
            self.on_dial_end(error, self.connections > before)

    async def _stream(self, session: aiohttp.ClientSession) -> None:
        # Discover before dialling: the control plane gives a fresh stream only
        # so long to register, and NVML can be slow to initialise.
        hw = await self.discover()
        async with session.ws_connect(self.url, ssl=self.ssl_context if self.ssl_context is not None else True,
                                      max_msg_size=MAX_MESSAGE, autoping=False) as ws:
            self.connections += 1
            self.ws = ws
            log.info("connected to %s", self.url)
            queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
            # Snapshot and queue hookup happen with no await in between, so no
            # transition can fall between what register says and what follows it.
            self.supervisor.accept_fields(())  # a fresh stream: nothing optional until its control plane says
            queue.put_nowait(self.register_message(hw))
            self._queue = queue
            sender = asyncio.create_task(self._sender(ws, queue), name="stream sender")
            rediscovery = (asyncio.create_task(self._rediscovery(hw), name="rediscovery")
                           if self.rediscover > 0 else None)
            heartbeat: asyncio.Task[None] | None = None
            self._advertised_keepalive, self.grace = None, DEFAULT_GRACE  # until ``liveness`` says
            self._answers_heartbeats, self._last_heartbeat = False, None  # until ``answers_heartbeats`` says
            pinger = asyncio.create_task(self._pinger(ws), name="stream pings")
            try:
                while True:
                    wait = self._ping_interval() + self.grace
                    try:
                        raw = await ws.receive(timeout=wait)
                    except asyncio.TimeoutError:
                        log.warning("nothing from the control plane for %.0fs (ping every %gs, grace %gs); "
                                    "dropping the stream", wait, self._ping_interval(), self.grace)
                        break
                    if raw.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED):
                        break
                    if raw.type == aiohttp.WSMsgType.PING:
                        await ws.pong(raw.data)  # a control plane that pings (older ones do)
                    elif raw.type == aiohttp.WSMsgType.TEXT:
                        hb = self._handle_text(raw.data)
                        if hb is not None:
                            if heartbeat is not None:
                                heartbeat.cancel()
                            heartbeat = asyncio.create_task(self._heartbeats(hb), name="heartbeats")
                    elif raw.type == aiohttp.WSMsgType.BINARY:
                        log.warning("control plane sent a binary frame; ignored (messages are JSON text)")
                    elif raw.type == aiohttp.WSMsgType.ERROR:
                        log.warning("stream error: %s", ws.exception())
                        break
                if sender.done() and sender.exception() is not None:
                    log.warning("sending failed: %s", sender.exception())
                log.warning("stream closed (code %s)", ws.close_code)
            finally:
                self._queue = None
                self.engine_signals.stop()  # the next control plane says what it wants, if anything
                for t in (sender, heartbeat, rediscovery, pinger):
                    if t is not None:
                        t.cancel()
                await asyncio.gather(*(t for t in (sender, heartbeat, rediscovery, pinger) if t is not None),
                                     return_exceptions=True)

    _advertised_keepalive: float | None = None  # the ping interval ``liveness`` asked for

    _retime: asyncio.Event | None = None  # set when ``liveness`` changes the ping interval
    _answers_heartbeats = False  # this stream's control plane answers heartbeats: they stand in for pings
    _last_heartbeat: float | None = None  # when the last heartbeat was written to this stream (monotonic)

    def _ping_due(self) -> bool:
        """A ping is sent unless a heartbeat, which the control plane answers, went out within a ping interval."""
        if not self._answers_heartbeats or self._last_heartbeat is None:
            return True
        return time.monotonic() - self._last_heartbeat >= self._ping_interval()

    def _ping_interval(self) -> float:
        return self._advertised_keepalive or self.keepalive

    async def _pinger(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        """A ping every ping interval: the control plane's answer shows the connection is alive.

        Nothing is judged here: the receive loop drops the stream when no
        frame at all has come within the interval plus the grace.
        """
        retime = self._retime = asyncio.Event()
        try:
            while True:
                try:
                    await compat.wait_for(retime.wait(), self._ping_interval())
                except TimeoutError:
                    if self._ping_due():
                        await ws.ping()
                else:  # ``liveness`` changed the interval: count it afresh from now
                    retime.clear()
        except (ConnectionError, aiohttp.ClientError, RuntimeError):
            pass  # the receive loop sees the connection end

    async def _sender(self, ws: aiohttp.ClientWebSocketResponse, queue: asyncio.Queue[dict[str, Any]]) -> None:
        await self.before_register()
        try:
            while True:
                msg = await queue.get()
                await ws.send_str(json.dumps(msg, separators=(",", ":")))
                if msg.get("type") == "heartbeat":
                    self._last_heartbeat = time.monotonic()
        except (ConnectionError, aiohttp.ClientError, RuntimeError) as e:
            log.warning("cannot send on stream: %s", e)
            await ws.close()

    async def _rediscovery(self, sent: HardwareInventory) -> None:
        """Rediscover every ``rediscover`` seconds; send the hardware whenever it differs from what was sent.

        A GPU that fell off the bus, one another process took, or an adapter
        port that left ACTIVE must stop being offered now, not at the next
        reconnection, which on a healthy link may be weeks away.
        """
        last = sent.to_dict()
        while True:
            await asyncio.sleep(self.rediscover)
            doc = (await self.discover()).to_dict()
            if doc != last:
                log.warning("hardware changed while connected: %d GPU(s), %d adapter(s); telling the control plane",
                            len(doc.get("gpus", [])), len(doc.get("hcas", [])))
                self.send({"type": "hardware", "hardware": doc})
                last = doc

    async def _heartbeats(self, interval: float) -> None:
        seq = 0
        while True:
            self.send({"type": "heartbeat", "seq": seq, "time": time.time()})
            seq += 1
            await asyncio.sleep(interval)

    # ---------------------------------------------------------------- receiving
    def _handle_text(self, data: str) -> float | None:
        """Act on one message; return the heartbeat interval when it was ``registered``."""
        try:
            msg = json.loads(data)
        except ValueError as e:
            log.warning("ignoring control-plane message that is not JSON (%s): %.200s", e, data)
            return None
        problems = incoming_problems(msg)
        if problems:
            log.warning("ignoring invalid control-plane message %.200s: %s", data, "; ".join(problems))
            return None
        self.fence.admit(msg)  # DeposedLeader ends this stream
        kind = msg["type"]
        if kind == "registered":
            self.epoch = int(msg["epoch"])
            self.backoff.reset()
            log.info("registered as %s (epoch %d, heartbeat every %gs)", self.node_id, self.epoch,
                     msg["heartbeat_interval"])
            self.on_registered()
            return float(msg["heartbeat_interval"])
        if kind == "liveness":
            self._advertised_keepalive, self.grace = float(msg["keepalive_interval"]), float(msg["stream_grace"])
            if self._retime is not None:
                self._retime.set()
            log.debug("pinging the control plane every %gs; waiting %gs past a ping for a word before redialling",
                     self._advertised_keepalive, self.grace)
        elif kind == "accepts":
            self.supervisor.accept_fields(msg["shard_status"])
            if "sleeping" in msg["shard_status"]:  # which engines sleep: only they know after restarts
                self._command(self.engine_sleep.recheck())
        elif kind == "answers_heartbeats":
            self._answers_heartbeats = True
            log.debug("the control plane answers heartbeats: pinging only when none went out for %gs",
                      self._ping_interval())
        elif kind == "kv_routes_accepted":
            self.on_kv_routes_accepted(msg)
        elif kind == "engine_signals_wanted":
            self.engine_signals.want(msg)
        elif kind == "start":
            try:
                self.supervisor.start(msg["spec"])
            except Exception:  # one bad start must not cost the node its stream
                log.exception("cannot act on start for %s", msg["spec"].get("shard_id"))
        elif kind == "stop":
            self._command(self.supervisor.stop(msg["shard_id"], msg.get("reason") or "stop requested"))
        elif kind == "drain":
            self._command(self.supervisor.stop(msg["shard_id"], "drain requested", drain=True))
        elif kind == "sleep":
            self._command(self.engine_sleep.sleep(msg["shard_id"], int(msg["level"])))
        elif kind == "wake":
            self._command(self.engine_sleep.wake(msg["shard_id"]))
        elif kind == "error":
            log.error("control plane refused this agent: %s", msg["reason"])
        return None

    def _command(self, coro: Awaitable[Any]) -> None:
        # Commands outlive the connection that carried them: a stop keeps
        # going even if the stream drops while the engine is shutting down.
        task = asyncio.ensure_future(coro)
        self._commands.add(task)
        task.add_done_callback(self._command_done)

    def _command_done(self, task: asyncio.Future[Any]) -> None:
        self._commands.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("command failed", exc_info=task.exception())
