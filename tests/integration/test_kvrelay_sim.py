"""The KV relay against a real engine simulator publishing vLLM's KV events over ipc:// sockets.

The relay runs on its own event loop and hands its upstream messages to a recorder. What the
engine stored before the relay subscribed comes back through the replay socket; a new engine
process behind the same sockets starts the replica's keys over with a reset; the keys are the
router-side hash of the prompts, and the messages hold no token id.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import tempfile
import threading
from itertools import count
from pathlib import Path

import httpx
import pytest

pytest.importorskip("zmq")

from llmgw.agent.kvrelay import KVRelay, Target  # noqa: E402
from llmgw.kvroutekeys import chain_keys, to_hex  # noqa: E402
from tests.integration.simproc import start_sim  # noqa: E402
from tests.support.polling import until  # noqa: E402

pytestmark = pytest.mark.integration

BS = 16
TOPIC = "kv@rep-1/r0"
_seed = count(1)


def kv_config(d: Path) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{d}/ev",
                       "replay_endpoint": f"ipc://{d}/replay", "topic": TOPIC})


def engine(d: Path):
    return start_sim("m", extra_args=["--enable-prefix-caching", "--block-size", str(BS),
                                      "--num-gpu-blocks-override", "400", "--kv-events-config", kv_config(d)])


def complete(sim, prompt: list[int]) -> None:
    httpx.post(f"{sim.base_url}/completions", timeout=60,
               json={"model": "m", "prompt": prompt, "max_tokens": 1}).raise_for_status()


def prompt(blocks: int) -> list[int]:
    base = 900_000_000 + 10_000 * next(_seed)  # nine digits: never by chance inside a hex key
    return [base + i for i in range(blocks * BS + 1)]


class Recorded:
    """The relay on a thread of its own, its messages kept in order."""

    def __init__(self, target: Target):
        self.target = target
        self.messages: list[dict] = []
        self.lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        stream = object()
        self.relay = KVRelay(targets=lambda: {self.target.shard_id: self.target}, send=self._send,
                             current_stream=lambda: stream, batch_delay=0.05, scan_interval=0.05,
                             replay_timeout=5.0)
        self.relay.accepted({"max_keys_per_message": 1024, "max_messages_per_second": 100})
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _send(self, msg):
        with self.lock:
            self.messages.append(json.loads(json.dumps(msg)))

    def _run(self):
        self.task = self.loop.create_task(self.relay.run())
        try:
            self.loop.run_until_complete(self.task)
        except asyncio.CancelledError:
            pass

    def stop(self):
        self.loop.call_soon_threadsafe(self.task.cancel)
        self.thread.join(30)

    def added(self) -> set[str]:
        with self.lock:
            return {k for m in self.messages for e in m["replicas"] for k in e.get("added", ())}

    def held(self) -> set[str]:
        out: set[str] = set()
        with self.lock:
            for m in self.messages:
                for e in m["replicas"]:
                    if e.get("reset"):
                        out.clear()
                    out -= set(e.get("removed", ()))
                    out |= set(e.get("added", ()))
        return out


def leaf_ok(doc) -> bool:
    """Nothing but the message's type, the ids, reset flags and 16-hex-digit keys: no number at all."""
    if isinstance(doc, dict):
        return all(leaf_ok(v) for v in doc.values())
    if isinstance(doc, list):
        return all(leaf_ok(v) for v in doc)
    return doc is True or (isinstance(doc, str) and (
        doc in ("kv_routes", "rep-1", "rep-1/r0") or re.fullmatch(r"[0-9a-f]{16}", doc) is not None))


def keys(p: list[int]) -> set[str]:
    return {to_hex(k) for k in chain_keys(p, BS)}


def pump(sim, rec: Recorded, want: set[str]) -> None:
    """PUB/SUB drops what is published before the subscription reaches the publisher: send
    one-block prompts until ``want`` has come through."""
    def arrived():
        if want <= rec.added():
            return True
        complete(sim, prompt(1))
        return want <= rec.added()
    until(arrived, "the keys to come through the relay", interval=0.2)


def test_replay_of_what_came_before_a_restart_resets_and_no_token_ids():
    d = Path(tempfile.mkdtemp(prefix="kvrelay-"))  # ipc:// paths must stay short
    sim = engine(d)
    rec = None
    try:
        before = prompt(3)
        complete(sim, before)  # batch 0, published before anyone listens
        rec = Recorded(Target("rep-1/r0", "rep-1", f"ipc://{d}/ev", f"ipc://{d}/replay", TOPIC, "life-1"))
        pump(sim, rec, keys(before))  # only through the replay socket
        assert rec.messages[0]["replicas"][0]["reset"] is True  # what was told before is stale
        assert keys(before) <= rec.held()
        assert rec.relay.gaps_lost == 0

        # another engine process behind the same sockets: its keys start over
        sim.stop()
        sim = engine(d)
        rec.target = Target("rep-1/r0", "rep-1", f"ipc://{d}/ev", f"ipc://{d}/replay", TOPIC, "life-2")
        after = prompt(2)
        complete(sim, after)
        pump(sim, rec, keys(after))
        held = rec.held()
        assert keys(after) <= held and not (keys(before) & held)
        text = json.dumps(rec.messages)
        assert not any(str(t) in text for t in before + after)
        assert all(leaf_ok(m) for m in rec.messages)
    finally:
        if rec is not None:
            rec.stop()
        sim.stop()
        shutil.rmtree(d, ignore_errors=True)
