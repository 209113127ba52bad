"""The engines' signals in the control plane: who is asked, what counts (fresh, current stream, Ready),
partial samples that hold the count, the period a large fleet is told, and the autoscaler fed by them."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from autoscale_docs import SERVER, errors
from reconciler_fleet import Fleet, catalog, make_ready

from llmgw.agent.stream import incoming_problems
from llmgw.catalog import Autoscale, Catalog
from llmgw.controlplane.autoscaler import Autoscaler
from llmgw.controlplane.enginesignals import Sample, SignalBook
from llmgw.controlplane.enginesignals_ask import Asked, Timing, timing, walk
from llmgw.controlplane.messages import MessageProblem, dumps, parse_up
from llmgw.settings import parse_server_settings

KEY = "tiny/sim"
STALE = 40.0


def on_signal(signal: str = "queue_depth", **kw) -> Catalog:
    cat = catalog(replicas=2)
    (dep,) = cat.deployments
    policy = Autoscale(**{"max": 4, "signal": signal, "target": 2, "stable_window": 10, "panic_window": 1, **kw})
    return dataclasses.replace(cat, deployments=(dataclasses.replace(dep, autoscale=policy),))


def two_ready(cat: Catalog) -> Fleet:
    f = Fleet("a", "b", gpus=1)
    f.step(cat, 0.0, replica_counts={KEY: 2})
    make_ready(f, 1.0)
    f.step(cat, 1.0, replica_counts={KEY: 2})
    return f


def rank0(f: Fleet) -> dict[str, tuple[str, str]]:
    """replica id -> (node, rank-0 shard id)"""
    return {r.replica_id: (r.shards[0].node_id, r.shards[0].shard_id) for r in f.rec.book.replicas.values()}


def owner_of(f: Fleet):
    def owner(node_id: str, shard_id: str) -> str | None:
        s = f.rec.book.find(node_id, shard_id)
        return s.replica_id if s is not None and s.rank == 0 else None
    return owner


def deployment_of(f: Fleet):
    return lambda rid: f.rec.book.replicas[rid].key if rid in f.rec.book.replicas else None


def sampled(book: SignalBook, cat: Catalog, f: Fleet, now: float, current=lambda n, e: True) -> dict:
    """What a pass reads, after the whole pass's members and a period's sweep."""
    book.set_members(walk(cat, f.rec.book)[1])
    book.sweep(now, Timing(5.0, 30.0, STALE), current, f.rec.book.replicas.__contains__)
    return book.samples()


def report(book: SignalBook, f: Fleet, values: dict[str, float | None], now: float, epoch: int = 1,
           signal: str = "queue_depth") -> None:
    where = rank0(f)
    for rid, v in values.items():
        node, sid = where[rid]
        book.apply(node, epoch, {"type": "engine_signals", "shards": [{"shard_id": sid, "signal": signal,
                                                                      "value": v}]}, now)


def test_a_sample_sums_every_ready_replicas_fresh_value():
    cat = on_signal()
    f = two_ready(cat)
    book = SignalBook(owner_of(f), deployment_of(f))
    a, b = sorted(rank0(f))
    report(book, f, {a: 3.0, b: 2.0}, now=10.0)
    assert sampled(book, cat, f, 12.0) == {KEY: Sample("queue_depth", 5.0, 2, 2)}


@pytest.mark.parametrize("why", ["missing", "stale", "old stream", "unreadable", "other signal"])
def test_a_replica_without_a_value_that_counts_makes_the_sample_partial(why):
    cat = on_signal()
    f = two_ready(cat)
    book = SignalBook(owner_of(f), deployment_of(f))
    a, b = sorted(rank0(f))
    report(book, f, {a: 3.0}, now=10.0)
    if why == "stale":
        report(book, f, {b: 2.0}, now=10.0 - STALE - 1)
    elif why == "old stream":
        report(book, f, {b: 2.0}, now=10.0, epoch=0)
    elif why == "unreadable":
        report(book, f, {b: None}, now=10.0)
    elif why == "other signal":  # sent before the agent heard of a changed policy
        report(book, f, {b: 0.5}, now=10.0, signal="kv_cache_use")
    got = sampled(book, cat, f, 10.0, lambda n, e: e == 1)[KEY]
    assert (got.total, got.reporting, got.replicas, got.partial) == (None, 1, 2, True)


def test_each_value_moves_its_deployments_sum_as_it_comes_and_a_sweep_drops_a_closed_streams():
    cat = on_signal()
    f = two_ready(cat)
    book = SignalBook(owner_of(f), deployment_of(f))
    a, b = sorted(rank0(f))
    node_a = rank0(f)[a][0]
    assert sampled(book, cat, f, 0.0)[KEY].partial
    report(book, f, {a: 3.0, b: 2.0}, now=1.0)
    assert book.samples()[KEY].total == 5.0  # read by the next pass, no sweep between
    report(book, f, {a: 1.0}, now=2.0)
    report(book, f, {b: None}, now=2.0)
    assert book.samples()[KEY] == Sample("queue_depth", None, 1, 2)
    report(book, f, {b: 4.0}, now=3.0)
    assert book.samples()[KEY].total == 5.0
    # a's stream closed: its value stops counting at the next sweep, a period after the last
    book.sweep(4.0, Timing(5.0, 30.0, STALE), lambda n, e: n != node_a, f.rec.book.replicas.__contains__)
    assert book.samples()[KEY].total == 5.0
    book.sweep(5.0, Timing(5.0, 30.0, STALE), lambda n, e: n != node_a, f.rec.book.replicas.__contains__)
    assert book.samples()[KEY] == Sample("queue_depth", None, 1, 2) and a not in book.values


def test_a_replica_ready_since_the_last_walk_counts_as_soon_as_it_reports():
    cat = on_signal()
    f = two_ready(cat)
    book = SignalBook(owner_of(f), deployment_of(f))
    a, b = sorted(rank0(f))
    book.set_members({KEY: ("queue_depth", 1)})  # the walk saw one Ready replica
    report(book, f, {a: 1.0}, now=1.0)
    assert book.samples()[KEY] == Sample("queue_depth", 1.0, 1, 1)
    report(book, f, {b: 1.0}, now=1.0)  # Ready since, and reporting: not left out until the next walk
    assert book.samples()[KEY] == Sample("queue_depth", 2.0, 2, 2)


def test_only_ready_replicas_count_and_none_ready_is_no_sample():
    cat = on_signal()
    f = Fleet("a", "b", gpus=1)
    f.step(cat, 0.0, replica_counts={KEY: 2})  # placed, not Ready
    book = SignalBook(owner_of(f), deployment_of(f))
    assert sampled(book, cat, f, 1.0) == {KEY: Sample("queue_depth", None, 0, 0)}


def test_a_node_cannot_report_for_a_replica_it_does_not_run():
    cat = on_signal()
    f = two_ready(cat)
    book = SignalBook(owner_of(f), deployment_of(f))
    a, b = sorted(rank0(f))
    (node_a, _), (_, sid_b) = rank0(f)[a], rank0(f)[b]
    book.apply(node_a, 1, {"type": "engine_signals", "shards": [{"shard_id": sid_b, "signal": "queue_depth",
                                                                "value": 100}]}, 1.0)
    assert book.refused == 1 and book.values == {}


def test_the_autoscaler_scales_on_a_whole_sample_and_holds_on_a_partial_one():
    cat = on_signal()
    f = two_ready(cat)
    scaler = Autoscaler()
    assert scaler.counts(cat, f.rec.book, 2.0, None, engine={KEY: Sample("queue_depth", 8.0, 2, 2)}) == {KEY: 4}
    assert scaler.decision(KEY).reason == "panic"  # 8 waiting / 2 per replica
    held = Autoscaler()
    # a partial sample: nothing observed, whatever the routers say
    assert held.counts(cat, f.rec.book, 2.0, {KEY: 99.0}, engine={KEY: Sample("queue_depth", None, 1, 2)}) == {KEY: 2}
    assert held.decision(KEY).reason == "start" and held.sample(KEY).partial


def test_the_explain_line_says_what_the_engines_showed():
    policy = on_signal().deployments[0].autoscale
    scaler = Autoscaler()
    cat = on_signal()
    f = two_ready(cat)
    scaler.counts(cat, f.rec.book, 2.0, None, engine={KEY: Sample("queue_depth", 6.0, 2, 2)})
    assert "6.00 waiting in the engines over 10s" in scaler.decision(KEY).explain(policy)


def test_each_node_is_asked_for_its_rank0_shards_with_the_rules_tolerance_as_dead_band():
    cat = on_signal(tolerance=0.25)
    f = two_ready(cat)
    want = walk(cat, f.rec.book)[0]
    assert {n: [(sid, sig, band) for sid, sig, band in v] for n, v in want.items()} == {
        node: [(sid, "queue_depth", 0.5)] for node, sid in rank0(f).values()}
    assert walk(catalog(replicas=2), f.rec.book)[0] == {}  # routers' load: nobody reads engines


def test_a_node_is_told_once_per_stream_and_again_on_a_change_an_empty_list_included():
    asked, t = Asked(), timing(5.0, 250.0, 1)
    want = {"a": (("a/r0", "queue_depth", 0.8),)}
    (first,) = asked.messages(want, {"a": 1, "b": 1}, t)  # b has nothing to read: nothing sent
    assert first == ("a", {"type": "engine_signals_wanted", "period": 5.0, "refresh": 30.0,
                           "shards": [{"shard_id": "a/r0", "signal": "queue_depth", "deadband": 0.8}]})
    assert incoming_problems(first[1]) == []  # what the agent checks it against
    assert asked.messages(want, {"a": 1}, t) == []
    assert [n for n, _ in asked.messages(want, {"a": 2}, t)] == ["a"]  # a new stream knows nothing
    assert asked.messages({}, {"a": 2}, t)[0][1]["shards"] == []  # told to stop
    assert asked.messages({}, {"a": 2}, t) == []


@pytest.mark.parametrize("nodes, period", [(1, 5.0), (1250, 5.0), (1251, 10.0), (10_000, 40.0)])
def test_a_large_fleet_is_told_a_longer_period_doubling(nodes, period):
    t = timing(5.0, 250.0, nodes)
    assert (t.period, t.refresh, t.stale_after) == (period, 6 * period, 8 * period)
    assert nodes / t.period <= 250.0


def test_the_period_stops_doubling_where_the_stream_schema_ends():
    assert timing(5.0, 250.0, 10**9).period == 2560.0
    assert timing(3600.0, 0.001, 10**6).period == 3600.0


def test_the_message_is_checked_at_its_pointer():
    ok = {"type": "engine_signals", "shards": [{"shard_id": "m.p.1-ab/r0", "signal": "kv_cache_use", "value": 0.5}]}
    assert parse_up(dumps(ok)) == ok
    for bad, where in [({**ok, "shards": []}, "shards"),
                       ({"type": "engine_signals", "shards": [{**ok["shards"][0], "value": -1}]}, "/shards/0/value"),
                       ({"type": "engine_signals", "shards": [{**ok["shards"][0], "signal": "x"}]}, "/shards/0/signal")]:
        with pytest.raises(MessageProblem, match=where):
            parse_up(dumps(bad))


@pytest.mark.parametrize("engine, block, pointer, words", [
    ("llamacpp", {"max": 2, "signal": "kv_cache_use", "target": 0.7}, "/deployments/0/autoscale/signal",
     "llamacpp, whose metrics have no kv_cache_use"),
    ("vllm", {"max": 2, "signal": "kv_cache_use"}, "/deployments/0/autoscale/target", "at most 1"),
    ("vllm", {"max": 2, "min": 0, "signal": "queue_depth"}, "/deployments/0/autoscale/min", "at least 1"),
])
def test_an_engine_signal_the_deployment_cannot_give_is_refused_at_its_key(engine, block, pointer, words):
    doc = copy.deepcopy(SERVER)
    doc["profiles"][0]["engine"] = engine
    if engine == "llamacpp":
        doc["models"][0]["source"] = "/models/m.gguf"
    doc["deployments"][0]["autoscale"] = block
    errs = errors(doc)
    assert pointer in errs and words in errs[pointer], errs


@pytest.mark.parametrize("engine, signal", [("vllm", "kv_cache_use"), ("sglang", "kv_cache_use"),
                                            ("llamacpp", "queue_depth")])
def test_an_engine_signal_the_engine_has_is_accepted(engine, signal):
    doc = copy.deepcopy(SERVER)
    doc["profiles"][0]["engine"] = engine
    if engine == "llamacpp":
        doc["models"][0]["source"] = "/models/m.gguf"
    doc["deployments"][0]["autoscale"] = {"max": 2, "signal": signal, "target": 0.7}
    (dep,) = parse_server_settings(doc).catalog.deployments
    assert dep.autoscale.signal == signal
