"""The book of prefill/decode proofs: who is held from the routers, who is tried, and when again."""

from __future__ import annotations

from reconciler_fleet import Fleet, make_ready

from llmgw.catalog import Catalog
from llmgw.controlplane.pairproof import PairProofs, bootstraps_of, urls_of
from llmgw.controlplane.reconcile.endpoints import endpoints


def ready_pair(prefill: int = 1, decode: int = 1) -> Fleet:
    cat = Catalog.from_config({
        "models": [{"name": "tiny", "source": "/models/tiny"}],
        "profiles": [{"name": "sim", "engine": "vllm", "start_timeout": 60}],
        "deployments": [{"model": "tiny", "profile": "sim", "disaggregation": {
            "connector": "nixl", "prefill": {"replicas": prefill}, "decode": {"replicas": decode}}}]})
    f = Fleet("a", gpus=prefill + decode)
    f.step(cat, 0.0)
    make_ready(f, 1.0)
    f.step(cat, 1.0)
    return f


def ids(f: Fleet, role: str) -> list[str]:
    return sorted(r for r in f.rec.book.replicas if f":{role}." in r)


def test_ready_prefill_replicas_are_held_and_tried_against_a_ready_decoder():
    f = ready_pair(prefill=2)
    book, proofs = f.rec.book, PairProofs(retry_after=5)
    urls = urls_of(endpoints(book, f.nodes))
    assert proofs.held(book) == frozenset(ids(f, "prefill"))
    trials = proofs.due(book, urls, 2.0)
    assert [t.prefill.replica_id for t in trials] == ids(f, "prefill")
    assert {t.decode.replica_id for t in trials} == set(ids(f, "decode"))
    assert trials[0].model == "tiny" and trials[0].prefill.url == urls[trials[0].prefill.replica_id]
    assert trials[0].prefill.api_key == book.replicas[trials[0].prefill.replica_id].shards[0].spec["api_key"]
    proofs.running.update(t.prefill.replica_id for t in trials)
    assert proofs.due(book, urls, 2.0) == []  # one proof at a time per replica


def test_a_proof_releases_a_replica_and_a_failure_is_retried_after_its_delay():
    f = ready_pair(prefill=2)
    book, proofs = f.rec.book, PairProofs(retry_after=5)
    urls = urls_of(endpoints(book, f.nodes))
    ok, bad = proofs.due(book, urls, 2.0)
    proofs.record(ok, None, 3.0)
    proofs.record(bad, "the decoder counted no transfer", 3.0)
    assert proofs.held(book) == {bad.prefill.replica_id}
    assert proofs.due(book, urls, 7.9) == []
    assert [t.prefill.replica_id for t in proofs.due(book, urls, 8.0)] == [bad.prefill.replica_id]


def test_nothing_is_tried_without_a_ready_decoder_and_gone_replicas_are_forgotten():
    f = ready_pair()
    book, proofs = f.rec.book, PairProofs()
    urls = urls_of(endpoints(book, f.nodes))
    no_decoder = {k: v for k, v in urls.items() if ":decode." not in k}
    assert proofs.due(book, no_decoder, 2.0) == []
    (trial,) = proofs.due(book, urls, 2.0)
    proofs.record(trial, None, 2.0)
    del book.replicas[trial.prefill.replica_id]
    proofs.due(book, urls, 3.0)
    assert proofs.proved == {}


def test_an_engine_restarted_under_the_same_replica_is_proved_again():
    f = ready_pair()
    book, proofs = f.rec.book, PairProofs()
    urls = urls_of(endpoints(book, f.nodes))
    (pid,) = ids(f, "prefill")
    shard = book.replicas[pid].shards[0]
    shard.process = {"pid": 100, "start_time": 5, "boot_id": "b"}
    (trial,) = proofs.due(book, urls, 2.0)
    proofs.record(trial, None, 2.0)
    assert proofs.held(book) == frozenset()
    # the agent restarted the engine in place: same replica, shard and state, a new process
    shard.process = {"pid": 200, "start_time": 9, "boot_id": "b"}
    assert proofs.held(book) == {pid}
    (again,) = proofs.due(book, urls, 3.0)
    assert again.prefill.replica_id == pid
    proofs.record(again, None, 3.0)
    assert proofs.held(book) == frozenset()


def test_a_proof_of_an_engine_that_restarted_meanwhile_does_not_release_the_new_one():
    f = ready_pair()
    book, proofs = f.rec.book, PairProofs()
    urls = urls_of(endpoints(book, f.nodes))
    (pid,) = ids(f, "prefill")
    shard = book.replicas[pid].shards[0]
    shard.process = None  # no process reported: the time rank 0 entered its state tells them apart
    (trial,) = proofs.due(book, urls, 2.0)
    shard.state_since += 7.0  # it left Ready and came back while the round trip ran
    proofs.record(trial, None, 9.0)
    assert proofs.held(book) == {pid}


def test_plain_replicas_are_never_held():
    f = Fleet("a", gpus=1)
    cat = Catalog.from_config({"models": [{"name": "tiny", "source": "/models/tiny"}],
                               "profiles": [{"name": "sim", "engine": "vllm"}],
                               "deployments": [{"model": "tiny", "profile": "sim", "replicas": 1}]})
    f.step(cat, 0.0)
    make_ready(f, 1.0)
    f.step(cat, 1.0)
    assert PairProofs().held(f.rec.book) == frozenset()


def test_an_sglang_prefill_replica_is_tried_at_its_bootstrap():
    f = ready_pair()
    book, proofs = f.rec.book, PairProofs()
    (pid,) = ids(f, "prefill")
    eps = [{**e, "bootstrap_port": 20417} if e["replica_id"] == pid else e for e in endpoints(book, f.nodes)]
    assert bootstraps_of(eps) == {pid: 20417}
    (trial,) = proofs.due(book, urls_of(eps), 2.0, bootstraps_of(eps))
    assert trial.prefill.bootstrap_port == 20417 and trial.decode.bootstrap_port is None
