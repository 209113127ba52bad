"""KV events on the wire, as vLLM's ``ZmqEventPublisher`` sends them (``--kv-events-config``).

A PUB socket bound on ``endpoint`` sends each batch as ``[topic, seq, payload]`` (seq an 8-byte
big-endian count from 0, payload ``llmgw.kvevents.encode_batch``); the last ``buffer_steps``
batches are kept, and a ROUTER on ``replay_endpoint`` answers a DEALER's ``[b"", start_seq]`` with
every kept batch from ``start_seq`` on, ``[b"", topic, seq, payload]``, then the end marker
``[b"", b"", -1, b""]``; a request of any other shape is ignored, as vLLM ignores it.

pyzmq is imported only here, and this module only when ``--kv-events-config`` enables events,
so a simulator without the flag never needs it.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import deque
from itertools import count
from typing import Any, Sequence

from llmgw.kvevents import REPLAY_END, EventBatch, KVEvent, encode_batch, encode_message, encode_replay
from llmgw.sim.sim_args import KVEventsConfig


class PublisherError(RuntimeError):
    """The publisher cannot start (pyzmq missing, an endpoint that cannot be bound)."""


def load_zmq() -> Any:
    try:
        import zmq
        import zmq.asyncio
    except ImportError:
        raise PublisherError("--kv-events-config needs pyzmq (the Python package 'pyzmq'), which is not "
                             "installed; install it or leave KV events off") from None
    return zmq


class KVEventPublisher:
    def __init__(self, cfg: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        zmq = load_zmq()
        self._zmq = zmq
        self.cfg = cfg
        self.rank = data_parallel_rank
        self._topic = cfg.topic
        self._seq = count()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        # PUB sends from plain code (a send never blocks: NOBLOCK, drops at the HWM); only the
        # replay ROUTER waits on the loop, through an asyncio view of the same context.
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context.shadow(self._ctx.underlying)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(cfg.hwm)
        self._replay = None
        self._task: asyncio.Task | None = None
        try:
            self._pub.bind(cfg.endpoint)
            if cfg.replay_endpoint is not None:
                self._replay = self._actx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (cfg.buffer_steps + 1))
                self._replay.bind(cfg.replay_endpoint)
        except zmq.ZMQError as e:
            self.close()
            raise PublisherError(f"cannot bind the KV-event endpoints: {e}") from None

    def start(self) -> None:
        """Serve replay requests on the running loop."""
        if self._replay is not None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: Sequence[KVEvent]) -> None:
        """One engine step's events as one numbered batch; a full PUB queue drops it (vLLM's HWM)."""
        if not events:
            return
        seq = next(self._seq)
        payload = encode_batch(EventBatch(time.time(), tuple(events), self.rank))
        try:
            self._pub.send_multipart(encode_message(self._topic, seq, payload), flags=self._zmq.NOBLOCK)
        except self._zmq.Again:
            pass
        self._buffer.append((seq, payload))

    async def _serve_replay(self) -> None:
        sock = self._replay
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3:
                sys.stderr.write(f"WARNING {time.strftime('%m-%d %H:%M:%S')} [kv_events.py:503] "
                                 f"Invalid replay request: {frames!r}\n")
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await sock.send_multipart([client, *encode_replay(self._topic, seq, payload)])
            await sock.send_multipart([client, *REPLAY_END])

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
