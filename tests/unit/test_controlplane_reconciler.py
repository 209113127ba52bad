"""Reconciler decisions from catalog + observations, with explicit times.

Each test drives the reconciler the way the agent service does (observe,
then reconcile) and asserts on the messages it would send and on the book.
"""

from __future__ import annotations

import dataclasses

import pytest
from reconciler_fleet import Fleet, GIB, POLICY, catalog, granted, make_ready, no_double_claims, report, starts, stops

from llmgw.catalog import Catalog
from llmgw.config import schema_errors
from llmgw.controlplane.lifecycle import NodeState, ReplacementLimiter
from llmgw.controlplane.reconciler import Drain, backoff, capacities, endpoints
from llmgw.controlplane.replicas import ReplicaState, slot_of
from llmgw.hardware.types import SickGPU


def test_places_each_declared_replica_once_and_claims_its_gpus():
    f = Fleet("a", "b", gpus=1)
    cat = catalog(replicas=2)
    plan = f.step(cat, 0.0)
    assert sorted(s.node_id for s in starts(plan)) == ["a", "b"]
    for s in starts(plan):
        assert schema_errors(s.message(), "stream") == []
        assert slot_of(s.spec["replica_id"], "tiny", "sim") in (0, 1)
    # Nothing is dispatched again while the shards are still starting.
    for t in range(1, 20):
        assert f.step(cat, float(t)).actions == []
    assert all(c.free_gpus == frozenset() for c in capacities(f.rec.book, f.nodes))
    no_double_claims(f)


def test_nothing_fits_says_why_and_never_overcommits():
    f = Fleet("a", gpus=1)
    plan = f.step(catalog(replicas=3), 0.0)
    assert len(starts(plan)) == 1
    assert len(plan.unplaced) == 2
    assert all("no placement" in why for why in plan.unplaced.values())
    no_double_claims(f)


def test_reconnect_keeps_serving_shards_and_sends_nothing():
    f = Fleet("a", "b", gpus=1)
    cat = catalog(replicas=2)
    plan = f.step(cat, 0.0)
    make_ready(f, 1.0)
    f.step(cat, 2.0)
    assert all(r.state is ReplicaState.READY for r in f.rec.book.replicas.values())
    # Agent a reconnects (new epoch) and reports its shard as it runs.
    spec_a = next(s.spec for s in starts(plan) if s.node_id == "a")
    f.register("a", [report(spec_a)], 3.0)
    plan = f.step(cat, 3.0)
    assert plan.actions == []
    assert all(r.state is ReplicaState.READY for r in f.rec.book.replicas.values())


def test_restart_rebuilds_replicas_from_reports_and_reclaims_gpus():
    old = Fleet("a", "b", gpus=2)
    cat = catalog(replicas=2)
    specs = [s.spec for s in starts(old.step(cat, 0.0))]
    placed_on = {s["shard_id"]: next(sh.node_id for r in old.rec.book.replicas.values() for sh in r.shards.values()
                                     if sh.shard_id == s["shard_id"]) for s in specs}

    # A fresh control plane: empty book, agents register with what they run.
    new = Fleet("a", "b", gpus=2)
    for node in ("a", "b"):
        mine = [report(s, pid=10 + i) for i, s in enumerate(specs) if placed_on[s["shard_id"]] == node]
        new.register(node, mine, 100.0)
    plan = new.step(cat, 100.0, in_grace=True)
    assert plan.actions == []
    plan = new.step(cat, 200.0)
    assert plan.actions == [], "adopted replicas are neither restarted nor stopped"
    assert sorted(new.rec.book.replicas) == sorted(s["replica_id"] for s in specs)
    assert all(r.state is ReplicaState.READY and r.adopted for r in new.rec.book.replicas.values())
    # Their GPUs are taken: a third replica goes only on the GPUs left free.
    plan = new.step(catalog(replicas=3), 201.0)
    (start,) = starts(plan)
    taken = {(placed_on[s["shard_id"]], g) for s in specs for g in s["gpu_indices"]}
    assert (start.node_id, start.spec["gpu_indices"][0]) not in taken
    no_double_claims(new)


def test_no_placement_during_startup_grace():
    f = Fleet("a")
    plan = f.step(catalog(replicas=1), 0.0, in_grace=True)
    assert plan.actions == []
    assert "startup grace" in plan.unplaced[("tiny/sim", 0)]
    assert len(starts(f.step(catalog(replicas=1), 5.0))) == 1


def test_empty_registration_lets_go_and_replaces_after_backoff():
    f = Fleet("a", gpus=1)
    cat = catalog(replicas=1)
    (first,) = starts(f.step(cat, 0.0))
    make_ready(f, 1.0)
    f.step(cat, 1.0)
    events = f.register("a", [], 10.0)
    assert any("let go" in e for e in events)
    plan = f.step(cat, 10.0)
    (r,) = f.rec.book.replicas.values()
    assert r.state is ReplicaState.FAILED and "vanished" in (r.failure or "")
    assert starts(plan) == [] and stops(plan) == []
    assert endpoints(f.rec.book, f.nodes) == []
    # The GPU is free again (nothing runs there) but the restart waits for the backoff.
    assert starts(f.step(cat, 14.0)) == []
    (again,) = starts(f.step(cat, 15.0))
    assert again.spec["replica_id"] != first.spec["replica_id"]
    assert slot_of(again.spec["replica_id"], "tiny", "sim") == 0
    assert again.spec["gpu_indices"] == [0]
    no_double_claims(f)


def test_failed_shard_restarts_with_exponential_backoff_and_keeps_its_output():
    f = Fleet("a", gpus=1)
    cat = catalog(replicas=1)
    now = 0.0
    delays = []
    for attempt in range(4):
        (s,) = starts(f.step(cat, now))
        f.rec.observe_status("a", {"type": "shard_status", "shard_id": s.spec["shard_id"], "state": "failed",
                                   "reason": "start_timeout 60s exceeded", "output_tail": f"boom {attempt}\n"}, now)
        f.step(cat, now)
        hist = f.rec.book.slot("tiny/sim", 0)
        assert hist.last_failure["output_tail"] == f"boom {attempt}\n"
        assert "start_timeout" in hist.last_failure["reason"]
        delays.append(hist.next_attempt_at - now)
        (r,) = f.rec.book.live()
        assert r.state is ReplicaState.FAILED
        now = hist.next_attempt_at
    assert delays == [5, 10, 20, 40]
    assert backoff(POLICY, 9) == 40
    # Ready resets the count.
    f.step(cat, now)
    make_ready(f, now + 1)
    f.step(cat, now + 1)
    assert f.rec.book.slot("tiny/sim", 0).failures == 0


def test_unknown_model_is_stopped_known_one_adopted():
    f = Fleet("a", gpus=2)
    cat = catalog(replicas=1)
    good = {"shard_id": "tiny.sim.0-aaaa/r0", "replica_id": "tiny.sim.0-aaaa", "rank": 0, "nnodes": 1,
            "gpu_indices": [0], "env": {}, "master_addr": None, "master_port": None,
            "model": {"name": "tiny", "source": "/models/tiny", "served_name": "tiny", "size_bytes": GIB},
            "profile": {"name": "sim", "engine": "vllm", "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                        "nodes": 1, "extra_args": [], "env": {}, "start_timeout": 60}}
    gone = {**good, "shard_id": "old.sim.0-bbbb/r0", "replica_id": "old.sim.0-bbbb", "gpu_indices": [1],
            "model": {**good["model"], "name": "old"}}
    f.register("a", [report(granted(good, "a")), report(granted(gone, "a"), pid=7)], 0.0)
    plan = f.step(cat, 10.0)
    assert [(a.node_id, a.shard_id) for a in stops(plan)] == [("a", "old.sim.0-bbbb/r0")]
    assert "not in the catalog" in stops(plan)[0].reason
    assert starts(plan) == []
    assert f.rec.book.replicas["tiny.sim.0-aaaa"].state is ReplicaState.READY
    # The stopped shard's GPU stays taken until the agent says it stopped.
    assert capacities(f.rec.book, f.nodes)[0].free_gpus == frozenset()
    assert f.step(cat, 11.0).actions == [], "a stop is sent once per stream"
    f.rec.observe_status("a", {"type": "shard_status", "shard_id": "old.sim.0-bbbb/r0", "state": "stopped"}, 12.0)
    f.step(cat, 12.0)
    assert capacities(f.rec.book, f.nodes)[0].free_gpus == frozenset({1})
    assert "old.sim.0-bbbb" not in f.rec.book.replicas


def test_stop_is_resent_on_a_new_stream_when_still_reported():
    f = Fleet("a")
    stray = {"shard_id": "x.y.0-cccc/r0", "replica_id": "x.y.0-cccc", "rank": 0, "nnodes": 1, "gpu_indices": [0],
             "env": {}, "model": {"name": "x", "source": "/x", "served_name": "x"},
             "profile": {"name": "y", "engine": "vllm", "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                         "nodes": 1, "extra_args": [], "env": {}, "start_timeout": 5}}
    f.register("a", [report(stray)], 0.0)
    assert len(stops(f.step(catalog(replicas=0), 0.0))) == 1
    f.register("a", [report(stray)], 1.0)
    assert len(stops(f.step(catalog(replicas=0), 1.0))) == 1
    f.register("a", [], 2.0)
    f.step(catalog(replicas=0), 2.0)
    assert f.rec.book.replicas == {}


def test_profile_change_replaces_one_replica_at_a_time():
    f = Fleet("a", "b", gpus=2)
    cat = catalog(replicas=2)
    f.step(cat, 0.0)
    make_ready(f, 1.0)
    f.step(cat, 1.0)
    changed = catalog(replicas=2, profile={"extra_args": ["--enforce-eager"]})
    plan = f.step(changed, 2.0)
    assert len(stops(plan)) == 1, "one old replica at a time"
    assert len(starts(plan)) == 1
    assert starts(plan)[0].spec["profile"]["extra_args"] == ["--enforce-eager"]
    plan = f.step(changed, 3.0)
    assert stops(plan) == [], "the second waits until the first replacement serves"
    # First replacement ready, old one stopped -> the second rolls.
    for r in list(f.rec.book.replicas.values()):
        for s in r.shards.values():
            if r.retired:
                f.rec.observe_status(s.node_id, {"type": "shard_status", "shard_id": s.shard_id, "state": "stopped"}, 4.0)
    make_ready(f, 4.0)
    f.step(changed, 4.0)  # the stopped one is forgotten
    plan = f.step(changed, 5.0)
    assert len(stops(plan)) == 1 and len(starts(plan)) == 1
    no_double_claims(f)


def test_shard_elsewhere_is_disowned_alone():
    f = Fleet("a", "b", gpus=1)
    cat = catalog(replicas=1)
    (s,) = starts(f.step(cat, 0.0))
    make_ready(f, 1.0)
    f.step(cat, 1.0)
    other = "b" if s.node_id == "a" else "a"
    # The other node claims to run the very same shard: not recognised there.
    f.register(other, [report(s.spec, pid=99)], 2.0)
    plan = f.step(cat, 2.0)
    assert [(a.node_id, a.shard_id) for a in stops(plan)] == [(other, s.spec["shard_id"])]
    (r,) = f.rec.book.live()
    assert r.state is ReplicaState.READY and r.shards[0].node_id == s.node_id


def test_unknown_running_status_is_stopped():
    f = Fleet("a")
    f.rec.observe_status("a", {"type": "shard_status", "shard_id": "ghost/r0", "state": "starting"}, 0.0)
    plan = f.step(catalog(replicas=0), 0.0)
    assert [(a.node_id, a.shard_id) for a in stops(plan)] == [("a", "ghost/r0")]


def test_status_from_another_node_changes_nothing():
    f = Fleet("a", "b", gpus=1)
    cat = catalog(replicas=1)
    (s,) = starts(f.step(cat, 0.0))
    other = "b" if s.node_id == "a" else "a"
    f.rec.observe_status(other, {"type": "shard_status", "shard_id": s.spec["shard_id"], "state": "failed"}, 1.0)
    (r,) = f.rec.book.live()
    assert r.shards[0].state == "pending"


def lose(f: Fleet, node: str) -> None:
    f.set(node, state=NodeState.LOST, connected=False)


def test_lost_node_replicas_placed_elsewhere_rate_limited():
    f = Fleet("a", "b", "c", gpus=2)
    f.limiter = ReplacementLimiter(per_minute=1)
    cat = catalog(replicas=2)
    plan = f.step(cat, 0.0)
    assert {s.node_id for s in starts(plan)} == {"a"}, "both fit on a, the best fit"
    make_ready(f, 1.0)
    f.step(cat, 1.0)
    f.set("a", state=NodeState.UNREACHABLE, connected=False)
    plan = f.step(cat, 2.0)
    assert plan.actions == [], "unreachable keeps its replicas"
    assert len(endpoints(f.rec.book, f.nodes)) == 2, "and the router keeps talking to them"
    lose(f, "a")
    plan = f.step(cat, 3.0)
    assert len(starts(plan)) == 1 and starts(plan)[0].node_id in ("b", "c")
    assert any("replacements_per_minute" in why for why in plan.unplaced.values()), plan.unplaced
    assert endpoints(f.rec.book, f.nodes) == []
    plan = f.step(cat, 63.5)
    assert len(starts(plan)) == 1
    no_double_claims(f)


def sicken(f: Fleet, node: str, gpu: int, reason: str) -> None:
    """What an agent advertises once it withholds ``gpu`` as sick."""
    inv = f.nodes[node].inventory.without_gpus({gpu}, [f"GPU {gpu} withheld: {reason}"])
    f.set(node, inventory=dataclasses.replace(inv, sick_gpus=(SickGPU(gpu, reason, 1.0),)))


def test_replica_on_a_gpu_withheld_as_sick_is_stopped_and_replaced_elsewhere_at_once():
    f = Fleet("a", "b", gpus=1)
    cat = catalog(replicas=1)
    (s,) = starts(f.step(cat, 0.0))
    make_ready(f, 1.0)
    f.step(cat, 1.0)
    sicken(f, s.node_id, 0, "Xid 79 (GPU has fallen off the bus)")
    plan = f.step(cat, 2.0)
    assert [(a.node_id, a.shard_id) for a in stops(plan)] == [(s.node_id, s.spec["shard_id"])]
    assert "GPU 0 on %s withheld as sick: Xid 79" % s.node_id in stops(plan)[0].reason
    (repl,) = starts(plan)
    assert repl.node_id != s.node_id, "placed where the GPU is not sick, with no backoff"
    hist = f.rec.book.slot("tiny/sim", 0)
    assert "Xid 79" in hist.last_failure["reason"] and hist.failures == 0
    no_double_claims(f)


def test_a_sick_gpu_no_replica_uses_stops_nothing():
    f = Fleet("a", gpus=2)
    cat = catalog(replicas=1)
    (s,) = starts(f.step(cat, 0.0))
    make_ready(f, 1.0)
    f.step(cat, 1.0)
    other = 1 - s.spec["gpu_indices"][0]
    sicken(f, "a", other, "3 uncorrected ECC error(s) since the last reset")
    assert f.step(cat, 2.0).actions == []


def test_damped_fleet_does_not_replace():
    f = Fleet("a", "b", gpus=1)
    cat = catalog(replicas=1)
    (s,) = starts(f.step(cat, 0.0))
    lose(f, s.node_id)
    plan = f.step(cat, 1.0, damped=True)
    assert starts(plan) == []
    assert "unreachable at once" in plan.unplaced[("tiny/sim", 0)]


def test_lost_node_returning_with_the_old_engine_is_surplus():
    f = Fleet("a", "b", gpus=1)
    cat = catalog(replicas=1)
    (s,) = starts(f.step(cat, 0.0))
    make_ready(f, 1.0)
    f.step(cat, 1.0)
    lose(f, s.node_id)
    (repl,) = starts(f.step(cat, 2.0))
    make_ready(f, 3.0)
    f.step(cat, 3.0)
    f.register(s.node_id, [report(s.spec)], 4.0)
    plan = f.step(cat, 4.0)
    assert [(a.node_id, a.shard_id) for a in stops(plan)] == [(s.node_id, s.spec["shard_id"])]
    (live,) = f.rec.book.live()
    assert live.replica_id == repl.spec["replica_id"]


def test_drain_leaves_router_stops_and_is_replaced():
    f = Fleet("a", gpus=2)
    cat = catalog(replicas=1)
    (s,) = starts(f.step(cat, 0.0))
    make_ready(f, 1.0)
    f.step(cat, 1.0)
    f.rec.drain(s.spec["replica_id"], 2.0)
    with pytest.raises(ValueError):
        f.rec.drain(s.spec["replica_id"], 2.0)
    plan = f.step(cat, 2.0)
    assert [type(a) for a in plan.actions if a.node_id == "a" and getattr(a, "shard_id", None) == s.spec["shard_id"]] == [Drain]
    (new,) = starts(plan)
    assert new.spec["gpu_indices"] == [1]
    eps = endpoints(f.rec.book, f.nodes)
    assert [(e["replica_id"], e["draining"]) for e in eps] == [(s.spec["replica_id"], True)]
    f.rec.observe_status("a", {"type": "shard_status", "shard_id": s.spec["shard_id"], "state": "stopped"}, 3.0)
    f.step(cat, 3.0)
    assert s.spec["replica_id"] not in f.rec.book.replicas


def test_catalog_removal_stops_everything_of_it():
    f = Fleet("a", gpus=2)
    f.step(catalog(replicas=2), 0.0)
    plan = f.step(catalog(replicas=0), 1.0)
    assert len(stops(plan)) == 2
    plan = f.step(catalog(replicas=1, model="other"), 2.0)
    assert stops(plan) == [] and starts(plan) == [], "GPUs still held by shards being stopped"


def test_multi_node_rank0_first_then_workers_with_rendezvous():
    f = Fleet("a", "b", gpus=1, fabric="ib-a")
    cat = Catalog.from_config({
        "models": [{"name": "tiny", "source": "org/tiny"}],
        "profiles": [{"name": "big", "engine": "vllm", "tensor_parallel_size": 2, "nodes": 2}],
        "deployments": [{"model": "tiny", "profile": "big", "replicas": 1}]})
    plan = f.step(cat, 0.0)
    (s0,) = starts(plan)
    assert s0.spec["rank"] == 0 and s0.spec["nnodes"] == 2
    assert f.step(cat, 1.0).actions == []
    assert all(c.free_gpus == frozenset() for c in capacities(f.rec.book, f.nodes)), "worker GPUs are promised"
    f.rec.observe_status(s0.node_id, {"type": "shard_status", "shard_id": s0.spec["shard_id"], "state": "starting",
                                      "port": 20001, "master_port": 29500}, 2.0)
    (s1,) = starts(f.step(cat, 2.0))
    assert s1.spec["rank"] == 1 and s1.node_id != s0.node_id
    assert s1.spec["master_port"] == 29500
    assert s1.spec["master_addr"] == f.nodes[s0.node_id].address
    assert schema_errors(s1.message(), "stream") == []


def test_adopted_multi_node_waits_for_its_other_rank_only_during_grace():
    f = Fleet("a", "b", gpus=1, fabric="ib-a")
    cat = Catalog.from_config({
        "models": [{"name": "tiny", "source": "org/tiny"}],
        "profiles": [{"name": "big", "engine": "vllm", "tensor_parallel_size": 2, "nodes": 2}],
        "deployments": [{"model": "tiny", "profile": "big", "replicas": 1}]})
    spec1 = {"shard_id": "tiny.big.0-dddd/r1", "replica_id": "tiny.big.0-dddd", "rank": 1, "nnodes": 2,
             "gpu_indices": [0], "env": {}, "master_addr": "10.0.0.1", "master_port": 29500,
             "model": {"name": "tiny", "source": "org/tiny", "served_name": "tiny"},
             "profile": {"name": "big", "engine": "vllm", "tensor_parallel_size": 2, "pipeline_parallel_size": 1,
                         "nodes": 2, "extra_args": [], "env": {}, "start_timeout": 900}}
    f.register("b", [report(granted(spec1, "b"))], 0.0)
    assert f.step(cat, 0.0, in_grace=True).actions == []
    spec0 = {**spec1, "shard_id": "tiny.big.0-dddd/r0", "rank": 0, "master_addr": None, "master_port": None}
    f.register("a", [report(granted(spec0, "a"))], 1.0)
    assert f.step(cat, 5.0).actions == []
    (r,) = f.rec.book.live()
    assert r.state is ReplicaState.READY


def test_each_replica_gets_its_own_engine_key_and_its_endpoint_carries_it():
    f = Fleet("a", "b", gpus=1)
    cat = catalog(replicas=2)
    plan = f.step(cat, 0.0)
    keys = [s.spec["api_key"] for s in starts(plan)]
    assert len(keys) == 2 and len(set(keys)) == 2, "one key per replica, never shared"
    assert all(len(k) >= 32 for k in keys)
    for s in starts(plan):
        assert schema_errors(s.message(), "stream") == []
    make_ready(f, 1.0)
    f.step(cat, 2.0)
    eps = endpoints(f.rec.book, f.nodes)
    assert sorted(e["api_key"] for e in eps) == sorted(keys)
    by_replica = {s.spec["replica_id"]: s.spec["api_key"] for s in starts(plan)}
    assert all(e["api_key"] == by_replica[e["replica_id"]] for e in eps)


def test_every_rank_of_a_multi_node_replica_carries_the_same_key():
    f = Fleet("a", "b", gpus=2, fabric="ib0")
    cat = catalog(replicas=1, profile={"name": "big", "engine": "vllm", "tensor_parallel_size": 2, "nodes": 2})
    (r0,) = starts(f.step(cat, 0.0))
    f.rec.observe_status(r0.node_id, {"type": "shard_status", "shard_id": r0.spec["shard_id"], "state": "starting",
                                      "port": 20001, "master_port": 29500,
                                      "process": {"pid": 1, "start_time": 1, "boot_id": "b"}}, 1.0)
    (r1,) = starts(f.step(cat, 1.0))
    assert r1.spec["rank"] == 1 and r1.spec["api_key"] == r0.spec["api_key"]


def test_a_restarted_control_plane_recovers_each_key_from_the_agents_reports():
    f = Fleet("a", "b", gpus=1)
    cat = catalog(replicas=2)
    plan = f.step(cat, 0.0)
    specs = {s.node_id: s.spec for s in starts(plan)}
    # A new control plane: an empty book, rebuilt from registrations alone.
    g = Fleet("a", "b", gpus=1)
    for node, spec in specs.items():
        g.register(node, [report(spec)], 10.0)
    assert starts(g.step(cat, 10.0)) == [], "adopted, not re-placed"
    eps = endpoints(g.rec.book, g.nodes)
    assert sorted(e["api_key"] for e in eps) == sorted(s["api_key"] for s in specs.values())


def test_a_replica_started_before_grants_is_stopped_and_placed_again():
    f = Fleet("a", gpus=1)
    cat = catalog(replicas=1)
    (start,) = starts(f.step(cat, 0.0))
    old = {k: v for k, v in start.spec.items() if k not in ("api_key", "grant")}
    g = Fleet("a", gpus=1)
    g.register("a", [report(old)], 5.0)
    (stop,) = stops(g.step(cat, 5.0))
    assert "no grant" in stop.reason and endpoints(g.rec.book, g.nodes) == []
    g.rec.observe_status("a", {"type": "shard_status", "shard_id": stop.shard_id, "state": "stopped"}, 6.0)
    (again,) = starts(g.step(cat, 6.0)) + starts(g.step(cat, 7.0))
    assert again.node_id == "a" and again.spec["grant"]["node_id"] == "a"
