"""The KV-event relay: engines' cache events in, route-key changes up the agent's stream.

Routers that know which replica holds a prompt's prefix send it there; the engines say what
they hold in their KV events, which carry the prompt's token ids. Those stay on the node: the
relay subscribes to each rank 0 that publishes (a profile's ``kv_events``; vLLM, over the
shard's ``ipc://`` sockets, ``llmgw.engines.vllm.kv_events_endpoints``), turns each stored block
into an opaque route key (``llmgw.kvroutekeys``; ``kvrelay_map``), and sends only the changes
to each replica's set of keys (``kvrelay_outbox``) over the stream the agent already holds. No
token id and no text leaves the node.

Sequence numbers: each batch is numbered by the engine. A gap is asked for again on the replay
socket; what the engine no longer keeps (or a malformed batch, or numbers starting over, which
is an engine that restarted) ends in a reset of that replica's keys upstream, after which the
relay keys what it sees from then on. A relay that starts (or subscribes to a new engine)
resets the replica first and replays from 0 whatever the engine still keeps.

Upstream: nothing is sent on a stream whose control plane has not announced
``kv_routes_accepted`` (an older one closes a stream on a message type it does not know), and
then at most its ``max_messages_per_second``, each of at most its ``max_keys_per_message`` keys.
Each new stream starts with a full resend (a reset and every key held), so a control plane that
restarted or missed messages while the stream was down is whole again after one pass.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Callable

from llmgw.agent.kvrelay_map import DEFAULT_MAX_BLOCKS, RouteMap
from llmgw.agent.kvrelay_outbox import DEFAULT_MAX_PENDING, Outbox, Pending
from llmgw.kvevents import KVEventDecodeError, Message, decode_message, decode_replay, encode_seq

log = logging.getLogger(__name__)

BATCH_DELAY = 0.25  # seconds changes wait to coalesce before a message
SCAN_INTERVAL = 1.0  # seconds between looks at which engines publish
REPLAY_TIMEOUT = 2.0  # seconds a replay may take before the gap counts as lost


@dataclass(frozen=True)
class Upstream:
    """What the control plane said it takes on one stream (``kv_routes_accepted``)."""

    stream: object  # the stream's WebSocket: a later stream must announce again
    max_keys: int
    min_gap: float  # seconds between messages


@dataclass(frozen=True)
class Target:
    """One engine that publishes: its rank-0 shard and sockets."""

    shard_id: str
    replica_id: str
    endpoint: str
    replay_endpoint: str
    topic: str
    generation: str = ""  # the engine process (pid and start time): another one starts over


def targets_of(supervisor: Any) -> dict[str, Target]:
    """The rank-0 shards with ``kv_events`` that have a launched engine, by shard id."""
    from llmgw.agent.statedir import socket_dir
    from llmgw.engines.vllm import kv_events_endpoints

    out = {}
    for s in supervisor.live_shards():
        profile = s.spec.get("profile") or {}
        if s.rank != 0 or not profile.get("kv_events") or not s.launched:
            continue
        d = str(socket_dir(supervisor.statedir.root, s.shard_id))
        ev, replay = kv_events_endpoints(d)
        ident = s.identity
        out[s.shard_id] = Target(s.shard_id, str(s.spec["replica_id"]), ev, replay, f"kv@{s.shard_id}",
                                 f"{ident.pid}@{ident.start_time}")
    return out


class KVRelay:
    def __init__(self, *, targets: Callable[[], dict[str, Target]], send: Callable[[dict[str, Any]], None],
                 current_stream: Callable[[], object], batch_delay: float = BATCH_DELAY,
                 scan_interval: float = SCAN_INTERVAL, replay_timeout: float = REPLAY_TIMEOUT,
                 max_blocks: int = DEFAULT_MAX_BLOCKS, max_pending: int = DEFAULT_MAX_PENDING) -> None:
        self._targets = targets
        self._send = send
        self._current_stream = current_stream
        self.batch_delay = batch_delay
        self.scan_interval = scan_interval
        self.replay_timeout = replay_timeout
        self.max_blocks = max_blocks
        self.max_pending = max_pending
        self.outbox = Outbox()
        self.maps: dict[str, RouteMap] = {}
        self._feeds: dict[str, asyncio.Task[None]] = {}
        self._following: dict[str, Target] = {}
        self._upstream: Upstream | None = None
        self._zmq: Any = None
        self.sent_messages = 0
        self.sent_keys = 0
        self.decode_errors = 0
        self.gaps_replayed = 0
        self.gaps_lost = 0

    # ------------------------------------------------------------------ upstream
    def accepted(self, msg: dict[str, Any]) -> None:
        """The control plane on the current stream takes ``kv_routes``: resend everything to it."""
        stream = self._current_stream()
        if stream is None:
            return
        self._upstream = Upstream(stream, int(msg["max_keys_per_message"]),
                                  1.0 / float(msg["max_messages_per_second"]))
        for p in self.outbox.replicas.values():
            p.resend()
        log.info("control plane takes KV route keys: resending %d replica(s)' keys", len(self.outbox.replicas))

    def _flush_once(self) -> float:
        """Send one message if the stream allows; the seconds to wait before the next."""
        up = self._upstream
        if up is None or self._current_stream() is not up.stream:
            return self.batch_delay
        msg = self.outbox.take(up.max_keys)
        if msg is None:
            return self.batch_delay
        self._send(msg)
        self.sent_messages += 1
        self.sent_keys += sum(len(e.get("added", ())) + len(e.get("removed", ())) for e in msg["replicas"])
        return max(up.min_gap, self.batch_delay if not self.outbox.due() else up.min_gap)

    # ------------------------------------------------------------------ engines
    def _scan(self) -> None:
        want = self._targets()
        for sid in [s for s, t in self._following.items() if want.get(s) != t]:
            self._feeds.pop(sid).cancel()
            self.maps.pop(sid, None)
            self.outbox.replicas.pop(sid, None)
            del self._following[sid]
            log.info("KV events of %s: no longer followed%s", sid, " (another engine process)" if sid in want else "")
        for sid, t in want.items():
            if sid in self._feeds:
                continue
            self._following[sid] = t
            pending = Pending(t.replica_id, t.shard_id, current=lambda sid=sid: self.maps[sid].keys(),
                              max_pending=self.max_pending)
            pending.reset_due = True  # whatever an earlier agent or stream told the control plane is stale
            self.outbox.replicas[sid] = pending
            self.maps[sid] = RouteMap(pending, self.max_blocks)
            task = self._feeds[sid] = asyncio.create_task(self._follow(t), name=f"kv events {sid}")
            task.add_done_callback(lambda task, sid=sid: self._ended(sid, task))
            log.info("KV events of %s (replica %s): following %s", sid, t.replica_id, t.endpoint)

    def _ended(self, sid: str, task: asyncio.Task[None]) -> None:
        """A feed that failed is followed afresh at the next scan (with a reset), not lost for good."""
        if task.cancelled() or self._feeds.get(sid) is not task:
            return
        log.error("KV events of %s: following them failed (%r); starting over", sid, task.exception())
        del self._feeds[sid]
        self._following.pop(sid, None)

    async def run(self) -> None:
        try:
            import zmq
            import zmq.asyncio
        except ImportError:
            log.error("KV events: pyzmq is not installed; no route keys are relayed")
            return
        self._zmq = zmq
        self._ctx = zmq.asyncio.Context()
        last_scan = -1e9
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    if loop.time() - last_scan >= self.scan_interval:
                        last_scan = loop.time()
                        self._scan()
                    wait = self._flush_once()
                except Exception:  # the relay is an optimisation: it must never take the agent down
                    log.exception("KV relay pass failed")
                    wait = self.scan_interval
                await asyncio.sleep(wait)
        finally:
            for t in self._feeds.values():
                t.cancel()
            await asyncio.gather(*self._feeds.values(), return_exceptions=True)
            self._ctx.destroy(linger=0)

    async def _follow(self, t: Target) -> None:
        zmq = self._zmq
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, t.topic.encode())
        sub.connect(t.endpoint)
        rmap = self.maps[t.shard_id]
        last: int | None = None
        try:
            while True:
                frames = await sub.recv_multipart()
                try:
                    msg = decode_message(frames)
                except KVEventDecodeError as e:
                    self.decode_errors += 1
                    log.warning("KV events of %s: a batch that cannot be read (%s): resetting its route keys",
                                t.shard_id, e)
                    rmap.reset()
                    last = None
                    continue
                if last is not None and msg.seq <= last:
                    log.warning("KV events of %s: numbers started over (%d after %d): the engine restarted; "
                                "resetting its route keys", t.shard_id, msg.seq, last)
                    rmap.reset()
                    last = None
                expected = 0 if last is None else last + 1
                if msg.seq > expected:
                    complete, missed = await self._replay(t, expected, msg.seq)
                    if complete:
                        self.gaps_replayed += last is not None
                    elif last is not None:  # a first subscription keeps what it can: its reset is already due
                        self.gaps_lost += 1
                        log.warning("KV events of %s: batches %d..%d are lost (not kept for replay); "
                                    "resetting its route keys", t.shard_id, expected, msg.seq - 1)
                        rmap.reset()
                    for m in missed:
                        rmap.apply(m.batch.events)
                rmap.apply(msg.batch.events)
                last = msg.seq
        finally:
            sub.close(linger=0)

    async def _replay(self, t: Target, start: int, end: int) -> tuple[bool, list[Message]]:
        """Batches ``start .. end-1`` from the replay socket: whether every one came, and the run of
        consecutive ones that ends at ``end - 1`` (what can still be applied after a loss; the
        parents of its first blocks may be unknown, and those blocks go unkeyed)."""
        zmq = self._zmq
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(t.replay_endpoint)
        got: dict[int, Message] = {}
        try:
            await dealer.send_multipart([b"", encode_seq(start)])
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.replay_timeout
            while True:
                left = deadline - loop.time()
                if left <= 0 or not await dealer.poll(left * 1000):
                    break
                try:
                    m = decode_replay(await dealer.recv_multipart())
                except KVEventDecodeError as e:
                    self.decode_errors += 1
                    log.warning("KV events of %s: a replayed batch that cannot be read: %s", t.shard_id, e)
                    continue
                if m is None:
                    break
                if start <= m.seq < end:
                    got[m.seq] = m
        finally:
            dealer.close(linger=0)
        run = end
        while run - 1 in got:
            run -= 1
        return run == start, [got[s] for s in range(run, end)]
