"""The KV relay's pure parts: route keys from the simulator's own KV events, coalesced deltas, the
control plane's bounded book, and the stream message's schema (no token ids fit in it)."""

from __future__ import annotations

import asyncio

import pytest

from llmgw.agent.kvrelay_map import RouteMap, cache_salt
from llmgw.agent.kvrelay_outbox import Outbox, Pending
from llmgw.controlplane.messages import MessageProblem, dumps, parse_up
from llmgw.controlplane.routekeys import RouteKeyBook
from llmgw.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, decode_batch, encode_batch
from llmgw.kvroutekeys import block_key, chain_keys, from_hex, to_hex
from llmgw.sim.sim_kvcache import KVCache

BS = 4


class Recorder:
    def __init__(self):
        self.added, self.removed, self.resets = [], [], 0

    def add(self, k):
        self.added.append(k)

    def remove(self, k):
        self.removed.append(k)

    def reset(self):
        self.resets += 1


def wire(events):
    """Through the wire format, as the relay receives them."""
    return decode_batch(encode_batch(EventBatch(0.0, tuple(events)))).events


def test_route_keys_chain_over_parent_tokens_and_extras():
    a = chain_keys([1, 2, 3, 4, 5, 6, 7, 8], BS)
    assert a[0] == block_key(None, [1, 2, 3, 4]) and a[1] == block_key(a[0], [5, 6, 7, 8])
    assert chain_keys([9, 9, 9, 9, 5, 6, 7, 8], BS)[1] != a[1]  # the prefix is in every key
    assert chain_keys([1, 2, 3, 4], BS, lora_name="ad")[0] != a[0]
    salted = chain_keys([1, 2, 3, 4, 5, 6, 7, 8], BS, salt="s")
    assert salted[0] != a[0] and salted[1] == block_key(salted[0], [5, 6, 7, 8])  # salt on the first block only
    assert chain_keys([1, 2, 3], BS) == []
    assert from_hex(to_hex(a[0])) == a[0] and len(to_hex(1)) == 16
    with pytest.raises(ValueError):
        from_hex("12")


def test_the_relay_keys_the_simulators_events_as_the_router_keys_the_prompt():
    cache = KVCache(num_blocks=6, block_size=BS, record_events=True)
    rec = Recorder()
    rmap = RouteMap(rec)
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    cache.release(cache.admit(prompt), generated=[])
    rmap.apply(wire(cache.drain()))
    assert rec.added == chain_keys(prompt, BS)
    # a second prompt sharing the first block: only its new block is stored, chained to the parent
    other = [11, 12, 13, 14, 40, 41, 42, 43, 44]
    cache.release(cache.admit(other))
    rmap.apply(wire(cache.drain()))
    assert rec.added[2:] == chain_keys(other, BS)[1:]
    # the cache fills: evictions remove exactly the keys of the evicted blocks
    cache.release(cache.admit([70 + i for i in range(4 * BS + 1)]))
    rmap.apply(wire(cache.drain()))
    assert rec.removed and set(rec.removed) <= set(chain_keys(prompt, BS) + chain_keys(other, BS))
    assert set(rmap.keys()) == set(rec.added) - set(rec.removed)
    rmap.apply([AllBlocksCleared()])
    assert rec.resets == 1 and rmap.keys() == []


def test_orphans_malformed_duplicates_and_the_bound():
    rec = Recorder()
    rmap = RouteMap(rec, max_blocks=3)
    rmap.apply([BlockStored((7,), 999, (1, 2, 3, 4), BS)])  # parent never seen
    rmap.apply([BlockStored((8,), None, (1, 2, 3), BS)])  # tokens do not fill the block
    assert rec.added == [] and rmap.counts.orphans == 1 and rmap.counts.malformed == 1
    rmap.apply([BlockStored((1,), None, (1, 2, 3, 4), BS), BlockStored((1,), None, (1, 2, 3, 4), BS)])
    rmap.apply([BlockRemoved((1,))])
    assert len(rec.added) == 1 and rec.removed == []  # a second holder keeps the key
    rmap.apply([BlockRemoved((1,))])
    assert rec.removed == rec.added
    rmap.apply([BlockStored((1, 2, 3), None, tuple(range(12)), BS), BlockStored((4,), 3, (5, 5, 5, 5), BS)])
    assert rec.resets == 1 and len(rmap) == 1  # past max_blocks: start over, never grow


def test_cache_salt_is_read_from_the_first_blocks_extra_keys():
    assert cache_salt(("salt",), None) == "salt"
    assert cache_salt(("lora", "salt"), "lora") == "salt"
    assert cache_salt(("lora",), "lora") is None and cache_salt(None, None) is None
    rec = Recorder()
    RouteMap(rec).apply([BlockStored((1, 2), None, tuple(range(8)), BS, extra_keys=(("s",), None))])
    assert rec.added == chain_keys(list(range(8)), BS, salt="s")


def test_outbox_coalesces_bounds_and_paces():
    out = Outbox()
    p = Pending("rep", "rep/r0", current=lambda: [1, 2, 3], max_pending=4)
    out.replicas["rep/r0"] = p
    p.add(10)
    p.remove(10)  # added then removed before sending: nothing
    p.remove(11)
    p.add(11)  # removed then added: nothing either
    assert not out.due()
    for k in range(5):
        p.add(k + 100)  # the fifth overflows: a full resend of the current set instead
    assert p.resends == 1
    msg = out.take(2)
    assert msg == {"type": "kv_routes", "replicas": [{"replica_id": "rep", "shard_id": "rep/r0", "reset": True,
                                                        "added": [to_hex(1), to_hex(2)]}]}
    assert out.take(10)["replicas"] == [{"replica_id": "rep", "shard_id": "rep/r0", "added": [to_hex(3)]}]
    assert out.take(10) is None


def kv_routes(entries):
    return {"type": "kv_routes", "replicas": entries}


def test_the_stream_takes_kv_routes_and_nothing_that_could_carry_tokens():
    ok = kv_routes([{"replica_id": "r1", "shard_id": "r1/r0", "reset": True, "added": [to_hex(5)]}])
    assert parse_up(dumps(ok)) == ok
    for bad in (kv_routes([{"replica_id": "r1", "shard_id": "r1/r0", "added": [5]}]),
                kv_routes([{"replica_id": "r1", "shard_id": "r1/r0", "token_ids": [1, 2]}]),
                kv_routes([{"replica_id": "r1", "shard_id": "r1/r0", "added": ["hello world prompt"]}]),
                kv_routes([])):
        with pytest.raises(MessageProblem):
            parse_up(dumps(bad))


def test_the_book_believes_a_node_only_about_its_own_replicas_and_stays_bounded():
    owner = {("n1", "r1/r0"): "r1"}
    book = RouteKeyBook(lambda n, s: owner.get((n, s)), max_keys=3)
    book.apply("n1", kv_routes([{"replica_id": "r1", "shard_id": "r1/r0", "added": [to_hex(k) for k in (1, 2, 3)]}]))
    book.apply("n2", kv_routes([{"replica_id": "r1", "shard_id": "r1/r0", "reset": True}]))  # not n2's
    book.apply("n1", kv_routes([{"replica_id": "r9", "shard_id": "r1/r0", "added": [to_hex(9)]}]))  # not r9's shard
    assert book.sizes() == {"r1": 3} and book.refused == 2
    book.apply("n1", kv_routes([{"replica_id": "r1", "shard_id": "r1/r0", "removed": [to_hex(2)],
                                 "added": [to_hex(4), to_hex(5)]}]))
    assert list(book.replicas["r1"].keys) == [3, 4, 5]  # the oldest dropped past the cap
    assert book.changes[-1].removed == (2, 1)
    book.forget("r1")
    assert book.sizes() == {} and book.changes[-1].reset


def test_the_relay_sends_only_on_a_stream_whose_control_plane_took_kv_routes():
    from llmgw.agent.kvrelay import KVRelay

    sent, stream = [], [object()]
    relay = KVRelay(targets=dict, send=sent.append, current_stream=lambda: stream[0])
    p = Pending("rep", "rep/r0", current=lambda: [7])
    relay.outbox.replicas["rep/r0"] = p
    p.add(7)
    relay._flush_once()
    assert sent == []  # an older control plane closes a stream on a type it does not know
    relay.accepted({"max_keys_per_message": 10, "max_messages_per_second": 5})
    assert relay._flush_once() >= 0.2 and sent[0]["replicas"][0] == {
        "replica_id": "rep", "shard_id": "rep/r0", "reset": True, "added": [to_hex(7)]}  # a new stream: all afresh
    p.add(8)
    stream[0] = object()  # a new stream that has not said it takes them
    relay._flush_once()
    assert len(sent) == 1


def test_the_book_answers_readers_with_deltas_or_everything_and_bounded():
    owner = {("n1", "r1/r0"): "r1", ("n1", "r2/r0"): "r2"}
    book = RouteKeyBook(lambda n, s: owner.get((n, s)), change_log=3)
    woken = []
    book.listeners.append(lambda: woken.append(1))
    book.apply("n1", kv_routes([{"replica_id": "r1", "shard_id": "r1/r0", "reset": True, "added": [to_hex(1)]}]))
    rev, full, reps = book.since(-1, None)  # a new reader: everything
    assert (rev, full, reps) == (1, True, [{"replica_id": "r1", "reset": True, "added": [to_hex(1)]}]) and woken
    book.apply("n1", kv_routes([{"replica_id": "r1", "shard_id": "r1/r0", "added": [to_hex(2), to_hex(3)]},
                                {"replica_id": "r2", "shard_id": "r2/r0", "added": [to_hex(4)]}]))
    assert book.since(1, book.epoch) == (3, False, [{"replica_id": "r1", "added": [to_hex(2), to_hex(3)]},
                                                    {"replica_id": "r2", "added": [to_hex(4)]}])
    assert book.since(1, book.epoch, max_keys=2) == (2, False, [{"replica_id": "r1", "added": [to_hex(2), to_hex(3)]}])
    assert book.since(3, book.epoch) == (3, False, [])
    assert book.since(3, "another control plane")[1] is True
    for k in range(5, 8):
        book.apply("n1", kv_routes([{"replica_id": "r2", "shard_id": "r2/r0", "added": [to_hex(k)]}]))
    assert book.since(1, book.epoch)[1] is True  # the log no longer reaches back: everything


def test_the_router_index_applies_answers_bounds_and_goes_stale():
    from llmgw.router.kvindex import KVIndex, KVIndexError

    index = KVIndex(max_keys=3, stale_after=10)
    chain = [11, 12, 13]
    assert not index.fresh("r1", 0.0) and index.held_prefix("r1", chain) == 0
    index.apply({"epoch": "e", "revision": 4, "full": True,
                 "replicas": [{"replica_id": "r1", "reset": True, "added": [to_hex(k) for k in chain]}]}, 100.0)
    assert index.held_prefix("r1", chain) == 3 and index.held_prefix("r1", [11, 99, 13]) == 1
    assert index.fresh("r1", 105.0) and not index.fresh("r1", 111.0) and not index.fresh("r2", 105.0)
    index.apply({"epoch": "e", "revision": 5, "replicas": [{"replica_id": "r1", "removed": [to_hex(11)],
                                                            "added": [to_hex(14), to_hex(15)]}]}, 106.0)
    assert list(index.replicas["r1"].keys) == [13, 14, 15] and index.revision == 5  # bounded: the oldest go
    for bad in ({"epoch": "e", "revision": 6, "replicas": [{"replica_id": "r1", "added": ["xyz"]}]},
                {"epoch": 1, "revision": 6, "replicas": []}, []):
        with pytest.raises(KVIndexError):
            index.apply(bad, 107.0)
    assert index.revision == 5 and list(index.replicas["r1"].keys) == [13, 14, 15]  # nothing half-applied
    index.forget_except({"r2"})
    assert index.sizes() == {}


class _Sock:
    """A scripted zmq.asyncio socket: SUB frames in order; DEALER answers a replay from ``kept``."""

    def __init__(self, script, kept):
        self.script, self.kept, self.answers = script, kept, []

    def setsockopt(self, *a):
        pass

    def connect(self, endpoint):
        pass

    def close(self, linger=0):
        pass

    async def recv_multipart(self):
        if self.answers:
            return self.answers.pop(0)
        if not self.script:
            await asyncio.sleep(3600)
        return self.script.pop(0)

    async def send_multipart(self, frames):
        from llmgw.kvevents import REPLAY_END, decode_seq, encode_replay

        start = decode_seq(frames[1])
        self.answers = [encode_replay("t", s, p) for s, p in sorted(self.kept.items()) if s >= start]
        self.answers.append(REPLAY_END)

    async def poll(self, ms):
        return 1 if self.answers else 0


class _Ctx:
    def __init__(self, script, kept):
        self.sub, self.kept = _Sock(script, kept), kept

    def socket(self, kind):
        return self.sub if kind == "SUB" else _Sock([], self.kept)


class _Zmq:
    SUB, DEALER, LINGER, SUBSCRIBE = "SUB", "DEALER", 0, 0


def _stored(h, parent, tokens):
    return encode_batch(EventBatch(0.0, (BlockStored((h,), parent, tuple(tokens), BS),)))


@pytest.mark.parametrize("case", ["replayed", "lost", "restarted"])
def test_the_relay_replays_a_gap_resets_on_a_loss_and_on_numbers_starting_over(case):
    from llmgw.agent.kvrelay import KVRelay, Target
    from llmgw.kvevents import encode_message

    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    ka = chain_keys(a, BS)[0]
    kb = block_key(ka, b)
    batches = {0: _stored(100, None, a), 1: _stored(101, 100, b), 2: _stored(102, 101, c)}
    kept = dict(batches) if case == "replayed" else {2: batches[2]}
    if case == "restarted":  # the engine's numbers start over after batch 2: a new engine, a new cache
        script = [encode_message("t", s, batches[s]) for s in (0, 1, 2)] + [encode_message("t", 0, _stored(200, None, c))]
    else:  # batch 1 never reached the subscriber
        script = [encode_message("t", s, batches[s]) for s in (0, 2)]
    relay = KVRelay(targets=dict, send=lambda m: None, current_stream=lambda: None, replay_timeout=0.2)
    relay._zmq, relay._ctx = _Zmq, _Ctx(script, kept)
    rec = Recorder()
    relay.maps["s"] = RouteMap(rec)
    target = Target("s", "rep", "ipc://x", "ipc://y", "t")

    async def go():
        task = asyncio.create_task(relay._follow(target))
        while relay._ctx.sub.script or relay._ctx.sub.answers:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(go())
    keys = set(relay.maps["s"].keys())
    if case == "replayed":
        assert keys == {ka, kb, block_key(kb, c)} and relay.gaps_replayed == 1 and rec.resets == 0
    elif case == "lost":  # batch 2's parent was in the lost batch: nothing can be keyed after the reset
        assert rec.resets == 1 and relay.gaps_lost == 1 and keys == set()
    else:
        assert rec.resets == 1 and keys == {block_key(None, c)}
