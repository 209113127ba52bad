"""Reading an engine's KV events as a router will: a ZMQ SUB on the publisher, and the replay
socket asked for everything from a sequence number (vLLM's and the simulator's alike)."""

from __future__ import annotations

import zmq

from llmgw.kvevents import BlockStored, Message, decode_message, decode_replay, encode_seq


class Subscriber:
    """A SUB socket on ``endpoint`` for ``topic``, keeping every message it has decoded."""

    def __init__(self, ctx: zmq.Context, endpoint: str, topic: str) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sock.connect(endpoint)
        self.got: list[Message] = []

    def pump(self) -> list[Message]:
        while self.sock.poll(50):
            self.got.append(decode_message(self.sock.recv_multipart()))
        return self.got

    def stored(self, tokens: list[int]) -> list[BlockStored]:
        """BlockStored events received so far whose blocks hold exactly ``tokens``."""
        self.pump()
        return [e for m in self.got for e in m.batch.events
                if isinstance(e, BlockStored) and e.token_ids == tuple(tokens)]

    def close(self) -> None:
        self.sock.close(linger=0)


def replay(ctx: zmq.Context, endpoint: str, start: int, wait: float = 60.0) -> list[Message]:
    """Every batch from sequence ``start`` on, as the replay socket at ``endpoint`` sends them."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", encode_seq(start)])
        out = []
        while True:
            assert dealer.poll(int(wait * 1000)), "the replay socket did not answer"
            msg = decode_replay(dealer.recv_multipart())
            if msg is None:
                return out
            out.append(msg)
    finally:
        dealer.close(linger=0)
