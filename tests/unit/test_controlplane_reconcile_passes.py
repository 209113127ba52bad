"""Each reconcile pass on its own: one job, run on a book, with explicit times.

``test_controlplane_reconciler.py`` drives the passes together through
``Reconciler.reconcile``; these call one pass at a time, so a rule that moves
to the wrong pass (or a pass that starts doing another's job) fails here by
name.  The book is set up by whole passes of a small fleet (``reconciler_fleet``).
"""

from __future__ import annotations

import ast
from pathlib import Path

from reconciler_fleet import KEYS, POLICY, Fleet, catalog, granted, make_ready, report, starts

import llmgw.controlplane.reconcile as passes
from llmgw.controlplane.lifecycle import NodeState
from llmgw.controlplane.reconcile import cleanup, failures, losses, observe, progress, rollout, slots, stopping
from llmgw.controlplane.reconcile.drain import drain_nodes
from llmgw.controlplane.reconcile.endpoints import endpoints
from llmgw.controlplane.reconcile.placement import Issuer, Room, place_missing
from llmgw.controlplane.reconcile.plan import Context, Drain, Plan, Start, Stop
from llmgw.controlplane.replicas import FAILED, GONE, READY, ReplicaBook, Shard


def placed(f: Fleet, cat, ready: bool = True):
    """One pass that places every slot; with ``ready``, every shard Ready and seen by a second pass."""
    plan = f.step(cat, 0.0)
    if ready:
        make_ready(f, 1.0)
        f.step(cat, 1.0)
    return plan


def ctx(**kw) -> Context:
    return Context(restart=POLICY, **kw)


def test_passes_do_no_io():
    """Pure logic apart from I/O: no pass imports sockets, clocks, threads or the control plane's loop."""
    io = {"asyncio", "socket", "time", "threading", "subprocess", "httpx", "aiohttp", "os",
          "llmgw.controlplane.state", "llmgw.controlplane.server", "llmgw.controlplane.sizing", "llmgw.weightprobe"}
    for path in sorted(Path(passes.__file__).parent.glob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
        assert not names & io, f"{path.name} imports {sorted(names & io)}"


def test_observe_refuses_an_ungranted_claim_and_adopts_a_granted_one():
    book, now = ReplicaBook(), 5.0
    spec = {"shard_id": "r1/r0", "replica_id": "r1", "rank": 0, "nnodes": 1, "gpu_indices": [0], "env": {},
            "master_addr": None, "master_port": None,
            "model": {"name": "tiny", "source": "/models/tiny"}, "profile": {"name": "sim", "engine": "vllm"}}
    refused: list[str] = []
    observe.observe_register(book, KEYS, "a", [report(spec)], now, refused)
    assert "r1" not in book.replicas and len(book.strays) == 1 and "refused" in refused[0]
    book = ReplicaBook()
    refused = []
    events = observe.observe_register(book, KEYS, "a", [report(granted(spec, "a"))], now, refused)
    assert refused == [] and "adopted" in events[-1]
    shard = book.replicas["r1"].shards[0]
    assert shard.node_id == "a" and shard.adopted and shard.spec["api_key"]  # key recomputed from the grant


def test_losses_let_go_of_a_lost_nodes_shards_and_replace_its_replicas_without_backoff():
    f = Fleet("a", gpus=1)
    placed(f, catalog(replicas=1))
    (r,) = f.rec.book.live()
    f.set("a", state=NodeState.LOST, connected=False)
    losses.forget_lost_nodes(f.rec.book, f.nodes, 10.0)
    assert r.shards[0].state == GONE and "lost" in r.shards[0].reason
    plan = Plan()
    losses.retire_on_lost_nodes(f.rec.book, f.nodes, 10.0, plan)
    assert r.retired and f.rec.book.slot(r.key, r.slot).needs_replacement_token
    assert f.rec.book.slot(r.key, r.slot).failures == 0
    assert plan.actions == [] and "replacing it" in plan.events[0]


def test_slots_retire_the_surplus_when_a_deployment_shrinks():
    f = Fleet("a", "b", gpus=1)
    placed(f, catalog(replicas=2))
    plan = Plan()
    (dep,) = catalog(replicas=1).deployments
    slots.assign_slots(f.rec.book, dep, 2.0, plan)
    live = list(f.rec.book.live())
    assert len(live) == 1 and live[0].slot == 0
    assert plan.actions == [] and "surplus" in plan.events[0]


def test_rollout_replaces_one_outdated_serving_replica_at_a_time():
    f = Fleet("a", "b", gpus=1)
    placed(f, catalog(replicas=2))
    plan = Plan()
    rollout.retire_uncatalogued(f.rec.book, catalog(replicas=2, profile={"extra_args": ["--enforce-eager"]}), 2.0, plan)
    assert len([r for r in f.rec.book.replicas.values() if r.retired]) == 1
    plan = Plan()
    rollout.retire_uncatalogued(f.rec.book, catalog(replicas=2, model="other"), 2.0, plan)
    assert all(r.retired for r in f.rec.book.replicas.values())
    assert all("not in the catalog" in e for e in plan.events)


def test_failures_back_off_and_retire_only_when_the_backoff_is_over():
    assert [failures.backoff(POLICY, n) for n in range(5)] == [0.0, 5, 10, 20, 40]
    assert failures.backoff(POLICY, 50) == 40
    f = Fleet("a", gpus=1)
    placed(f, catalog(replicas=1), ready=False)
    (r,) = f.rec.book.live()
    r.shards[0].state = FAILED
    plan = Plan()
    failures.check_failures(f.rec.book, r, 3.0, ctx(), plan)
    assert r.failed_at == 3.0 and f.rec.book.slot(r.key, r.slot).next_attempt_at == 8.0
    failures.stop_failed(f.rec.book, r, f.nodes, 4.0, plan)
    assert not r.retired and plan.actions == [], "an ended shard is not told to stop; the failure stays shown"
    failures.stop_failed(f.rec.book, r, f.nodes, 8.0, plan)
    assert r.retired and "replaced after failure" in r.retire_reason


def test_progress_notes_ready_and_forgives_the_slots_failures():
    f = Fleet("a", gpus=1)
    placed(f, catalog(replicas=1), ready=False)
    (r,) = f.rec.book.live()
    f.rec.book.slot(r.key, r.slot).failures = 3
    for s in r.shards.values():
        s.state = READY
    plan = Plan()
    progress.advance(f.rec.book, r, f.nodes, 7.0, plan)
    assert r.ready_since == 7.0 and f.rec.book.slot(r.key, r.slot).failures == 0
    assert plan.events == [f"{r.replica_id}: ready"] and plan.actions == []


def test_cleanup_forgets_a_released_stray_and_stops_a_running_one_once():
    f = Fleet("a", gpus=1)
    book = f.rec.book
    book.add_stray(Shard(shard_id="x/0", replica_id="x", rank=0, node_id="a", gpu_indices=(0,), spec={},
                         state="ready", state_since=0.0, reason="not ours"))
    plan = Plan()
    cleanup.clean_strays(book, f.nodes, plan)
    cleanup.clean_strays(book, f.nodes, plan)
    assert plan.actions == [Stop("a", "x/0", "not ours")]
    next(iter(book.strays.values())).state = "stopped"
    cleanup.clean_strays(book, f.nodes, plan)
    assert not book.strays


def test_cleanup_drains_an_operators_drain_before_stopping_and_forgets_the_replica_once_released():
    f = Fleet("a", gpus=1)
    placed(f, catalog(replicas=1))
    (r,) = f.rec.book.live()
    f.rec.drain(r.replica_id, 2.0)
    plan = Plan()
    cleanup.clean_retired(f.rec.book, f.nodes, 3.0, plan)
    assert plan.actions == [Drain("a", r.shards[0].shard_id)]
    r.shards[0].state = "stopped"
    cleanup.clean_retired(f.rec.book, f.nodes, 4.0, plan)
    assert r.replica_id not in f.rec.book.replicas


def test_placement_counts_the_fleet_only_when_it_places():
    f = Fleet("a", gpus=1)
    cat = catalog(replicas=2)
    room, plan = Room(f.rec.book, f.nodes), Plan()
    issuer = Issuer(KEYS, 1, lambda: "0001")
    place_missing(f.rec.book, issuer, cat, cat.deployments[0], 0.0, ctx(in_grace=True), plan, room)
    assert plan.actions == [] and "startup grace" in plan.unplaced[(cat.deployments[0].key, 0)]
    assert not room.counted, "a pass that places nothing counts no capacity"
    plan = Plan()
    place_missing(f.rec.book, issuer, cat, cat.deployments[0], 0.0, ctx(), plan, room)
    (start,) = [a for a in plan.actions if isinstance(a, Start)]
    assert start.spec["grant"] and start.spec["replica_id"].endswith("0001")
    assert list(plan.unplaced) == [(cat.deployments[0].key, 1)], "the second slot does not fit"


def test_drain_places_a_twin_first_and_drains_the_old_replica_once_the_twin_is_ready():
    f = Fleet("a", "b", gpus=1)
    cat = catalog(replicas=1)
    (s,) = starts(placed(f, cat))
    old = f.rec.book.replicas[s.spec["replica_id"]]
    f.set(s.node_id, cordon="draining")
    plan = Plan()
    issuer = Issuer(KEYS, 1, None)
    drain_nodes(f.rec.book, issuer, cat, f.nodes, 2.0, ctx(), plan, Room(f.rec.book, f.nodes))
    (twin,) = [r for r in f.rec.book.live() if r.surge_for == old.replica_id]
    assert twin.slot is None and not old.retired and [type(a) for a in plan.actions] == [Start]
    make_ready(f, 3.0)
    twin.ready_since = 3.0
    plan = Plan()
    drain_nodes(f.rec.book, issuer, cat, f.nodes, 4.0, ctx(), plan, Room(f.rec.book, f.nodes))
    assert old.retired and old.draining and twin.slot == old.slot and twin.surge_for is None
    assert plan.actions == [Drain(s.node_id, old.shards[0].shard_id)]


def test_stopping_gives_back_a_never_sent_shard_and_tells_a_node_once_per_epoch():
    f = Fleet("a", gpus=1)
    placed(f, catalog(replicas=1), ready=False)
    (r,) = f.rec.book.live()
    s = r.shards[0]
    plan = Plan()
    stopping.stop_shards(r, f.nodes, plan, "why")
    stopping.stop_shards(r, f.nodes, plan, "why")
    assert plan.actions == [Stop("a", s.shard_id, "why")]
    f.set("a", epoch=f.nodes["a"].epoch + 1)
    stopping.stop_shards(r, f.nodes, plan, "why")
    assert len(plan.actions) == 2, "a new stream is told again"
    s.state, s.dispatched_at = "waiting", None
    stopping.stop_shards(r, f.nodes, plan, "why")
    assert s.state == GONE and len(plan.actions) == 2


def test_endpoints_bracket_an_ipv6_address_and_mark_a_draining_replica():
    f = Fleet("a", gpus=1)
    placed(f, catalog(replicas=1))
    (r,) = f.rec.book.live()
    r.shards[0].address = "fd00::1"
    (ep,) = endpoints(f.rec.book, f.nodes)
    assert ep["url"] == f"http://[fd00::1]:{r.shards[0].port}" and not ep["draining"]
    f.rec.drain(r.replica_id, 2.0)
    (ep,) = endpoints(f.rec.book, f.nodes)
    assert ep["draining"]
