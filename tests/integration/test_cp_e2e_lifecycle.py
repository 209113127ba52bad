"""Zone-disruption damping and the replacement rate limit, with real processes.

A frozen agent (SIGSTOP) keeps its TCP connection and says nothing: the
shape of a node behind a dead link.  Its engines, in their own process
groups, keep running.  Everything is read back through the admin API,
``/metrics`` and the server's log.
"""

from __future__ import annotations

import signal

import pytest

from fleet import Fleet, log_times, metric_samples, until

pytestmark = pytest.mark.integration


def gauge(f: Fleet, name: str, **labels: str) -> float | None:
    for got, value in metric_samples(f).get(name, []):
        if all(got.get(k) == v for k, v in labels.items()):
            return value
    return None


def by_node(ready: list[dict]) -> dict[str, dict]:
    return {r["shards"][0]["node_id"]: r for r in ready}


def freeze_most_of_the_fleet(f: Fleet, names: list[str], frozen: list[str]) -> tuple[dict, dict]:
    """All replicas ready one per node, then SIGSTOP ``frozen`` agents until damping holds them.

    Returns (replica per node id, engine pid per node id) from before the freeze.
    """
    f.start()
    ready = f.wait_ready(len(names), extra=lambda rs: len({r["shards"][0]["node_id"] for r in rs}) == len(names))
    before = by_node(ready)
    pids = {n: r["shards"][0]["pid"] for n, r in before.items()}
    assert sorted(pids.values()) == f.engine_pids()
    assert gauge(f, "llmgw_fleet_damped") == 0.0
    frozen_ids = {f.node_ids[n] for n in frozen}
    for n in frozen:
        f.agents[n].signal(signal.SIGSTOP)

    def held() -> dict | None:
        doc = f.get("/v1/nodes")
        fleet = doc["fleet"]
        states = {n["node_id"]: n["state"] for n in doc["nodes"]}
        assert not any(states[i] == "lost" for i in frozen_ids), doc
        # Held: silent past lost_after, and still not declared lost.
        if fleet["damped"] and fleet["hold_reason"] and all(states[i] == "unreachable" for i in frozen_ids):
            return doc
        return None

    doc = until(held, "the frozen nodes past lost_after, held unreachable by damping", on_timeout=f.dump)
    share = len(frozen) / len(names)
    assert doc["fleet"]["unreachable_share"] == share
    assert "no node is declared lost" in doc["fleet"]["hold_reason"]
    assert gauge(f, "llmgw_fleet_damped") == 1.0
    assert gauge(f, "llmgw_fleet_unreachable_share") == share
    for i in frozen_ids:
        assert gauge(f, "llmgw_node_state", node=i, state="unreachable") == 1.0
        assert gauge(f, "llmgw_node_state", node=i, state="lost") == 0.0
    # Nothing was rescheduled: the same replicas, the same engines, and no new placement.
    reps = f.replicas()
    assert {r["replica_id"] for r in reps["replicas"]} == {r["replica_id"] for r in before.values()}
    assert all(r["state"] == "ready" for r in reps["replicas"]), reps
    assert f.engine_pids() == sorted(pids.values())
    log = f.server.output(10**7)
    assert "treated as a control-plane-side network fault, no node is declared lost" in log
    assert "-> lost" not in log and "replacing it" not in log
    assert log.count(": placed (") == len(names)
    return before, pids


def all_back(f: Fleet) -> dict | None:
    doc = f.get("/v1/nodes")
    ok = (not doc["fleet"]["damped"] and len(doc["nodes"]) == len(f.agents)
          and all(n["state"] == "ready" and n["connected"] for n in doc["nodes"]))
    return doc if ok else None


def test_freezing_most_of_the_fleet_is_damped_nothing_lost_nothing_moved(tmp_path):
    names = ["a", "b", "c", "d"]
    with Fleet(tmp_path, nodes={n: 1 for n in names}, replicas=4,
               lifecycle={"max_unreachable_share": 0.55, "replacements_per_minute": 30}) as f:
        freeze_most_of_the_fleet(f, names, names[:3])  # 3 of 4 = 75% > 55%
        for n in names[:3]:
            f.agents[n].signal(signal.SIGCONT)
        until(lambda: all_back(f), "every node ready and connected again", on_timeout=f.dump)
        assert gauge(f, "llmgw_fleet_damped") == 0.0
        f.wait_ready(4)


def test_a_damped_fleet_thawing_node_by_node_keeps_every_engine(tmp_path):
    names = ["a", "b", "c", "d"]
    with Fleet(tmp_path, nodes={n: 1 for n in names}, replicas=4,
               lifecycle={"max_unreachable_share": 0.55, "replacements_per_minute": 30}) as f:
        frozen = names[:3]
        before, pids = freeze_most_of_the_fleet(f, names, frozen)
        # The partition heals one node at a time, as real links come back.
        for n in frozen:
            f.agents[n].signal(signal.SIGCONT)
            nid = f.node_ids[n]
            until(lambda: (x := f.nodes()[nid])["connected"] and x["state"] == "ready",
                  f"{n} back", on_timeout=f.dump)
        until(lambda: all_back(f), "every node ready and connected again", on_timeout=f.dump)
        after = by_node(f.wait_ready(4))
        log = f.server.output(10**7)
        assert "-> lost" not in log, log[-5000:]
        assert {n: r["replica_id"] for n, r in after.items()} == {n: r["replica_id"] for n, r in before.items()}
        assert {n: r["shards"][0]["pid"] for n, r in after.items()} == pids
        assert f.engine_pids() == sorted(pids.values())
        assert log.count(": placed (") == 4


def test_replicas_of_a_lost_node_are_replaced_no_faster_than_replacements_per_minute(tmp_path):
    per_minute = 2
    with Fleet(tmp_path, nodes={"a": 3, "b": 3}, replicas=3,
               lifecycle={"replacements_per_minute": per_minute, "max_unreachable_share": 0.55}) as f:
        # Only "a" at first, so all three replicas land on it.
        f.start(agents=False)
        f.agents["a"].start()
        a, b = f.node_ids["a"], f.node_ids["b"]
        old = f.wait_ready(3)
        assert {r["shards"][0]["node_id"] for r in old} == {a}
        f.agents["b"].start()
        until(lambda: f.nodes().get(b, {}).get("state") == "ready", "node b registered", on_timeout=f.dump)

        f.agents["a"].signal(signal.SIGSTOP)
        until(lambda: f.nodes()[a]["state"] == "lost", "node a lost", on_timeout=f.dump)

        def on_b() -> list[dict]:
            return [r for r in f.replicas()["replicas"] if r["shards"][0]["node_id"] == b]

        # The bucket holds per_minute tokens: that many are replaced, the rest are held.
        first = until(lambda: len(on_b()) >= per_minute and on_b(), f"{per_minute} replacements placed on b",
                      on_timeout=f.dump)
        doc = f.replicas()
        held = [u for u in doc["unplaced"] if "replacements_per_minute reached" in u["reason"]]
        assert len(on_b()) == per_minute, doc
        assert len(held) == 3 - per_minute, doc
        assert all("lost" in (u["last_failure"] or {}).get("reason", "") for u in held), doc
        assert all("lost" in r["last_failure"]["reason"] for r in first)

        until(lambda: len(on_b()) == 3, "the last replacement, once a token is back", on_timeout=f.dump)
        f.wait_ready(3, extra=lambda rs: all(r["shards"][0]["node_id"] == b for r in rs))
        log = f.server.output(10**7)
        lost_at = log_times(log, f"node {a}: unreachable -> lost")
        placed = sorted(t for t in log_times(log, ": placed (") if t >= lost_at[0])
        events = [ln for ln in log.splitlines() if ": placed (" in ln or "->" in ln or "fail" in ln]
        assert len(lost_at) == 1 and len(placed) == 3, (lost_at, placed, events[-40:])
        # Not all at once: the last one waited for the bucket to refill a token
        # (60/per_minute seconds after the bucket was first drawn on).
        refill = 60.0 / per_minute
        assert placed[per_minute] - placed[0] >= refill - 0.5, (placed, refill)
        assert "replacement held: replacements_per_minute reached" in log
