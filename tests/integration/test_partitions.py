"""Real network partitions: agents in their own network namespaces, cut off by blackhole routes.

See ``netns.py``.  Root only (CI runs as root); elsewhere every test here is
skipped with the reason.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from fleet import edit_agent_config, gpu_owners, process_start_time, until
from netns import DelayRelay, Network, netem_unavailable, netns_fleet, unavailable

WHY_NOT = unavailable()
pytestmark = [pytest.mark.integration, pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")]

LIFECYCLE = {"unreachable_after": 3.0, "lost_after": 8.0, "startup_grace": 2.0, "max_unreachable_share": 0.55}


class EndpointSampler:
    """Polls the control plane's endpoint set (what the router routes to) in a thread."""

    def __init__(self, f):
        self.f, self.samples, self._stop = f, [], threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            doc = self.f.try_get("/v1/router/endpoints?after=-1")
            if doc is not None:
                self.samples.append(sorted(e["url"] for e in doc["endpoints"]))
            self._stop.wait(0.2)

    def __enter__(self) -> "EndpointSampler":
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(60)


def shard_of(rep: dict[str, Any]) -> dict[str, Any]:
    (s,) = rep["shards"]
    return s


@pytest.mark.parametrize("direction", ["both", "from_cp", "to_cp"])
def test_a_node_cut_off_past_lost_after_is_replaced_and_its_stale_engine_stopped_when_it_heals(tmp_path, direction):
    # from_cp: the agent's heartbeats still arrive, but nothing the control plane sends does; a node
    # that cannot be told to start or stop anything must not pass for ready.
    with Network(["a", "b"]) as net, netns_fleet(tmp_path, net, {"a": 1, "b": 1}, replicas=1, router=True,
                                                lifecycle=LIFECYCLE) as f:
        f.start()
        (rep,) = f.wait_ready(1)
        old = shard_of(rep)
        cut = next(n for n, nid in f.node_ids.items() if nid == old["node_id"])
        other = next(n for n in f.node_ids if n != cut)
        old_pid, old_start = old["process"]["pid"], old["process"]["start_time"]
        with EndpointSampler(f) as sampler:
            net.cut(cut, direction)
            until(lambda: (f.try_node(cut) or {}).get("state") == "lost", f"{cut} declared lost", on_timeout=f.dump)
            (new,) = f.wait_ready(1, extra=lambda rs: shard_of(rs[0])["node_id"] == f.node_ids[other])
            assert process_start_time(old_pid) == old_start, "the cut-off engine still runs: nobody could tell it"
            net.heal(cut)
            until(lambda: process_start_time(old_pid) != old_start, "the stale engine stopped after the heal",
                  on_timeout=f.dump)
            until(lambda: (f.try_node(cut) or {}).get("state") == "ready", f"{cut} ready again", on_timeout=f.dump)
            time.sleep(1.0)  # a few more samples after the heal
        (after,) = f.wait_ready(1)
        assert after["replica_id"] == new["replica_id"], "the replacement keeps serving"
        assert all(len(v) == 1 for v in gpu_owners(f.replicas()).values()), gpu_owners(f.replicas())
        assert f.engine_pids() == [shard_of(after)["process"]["pid"]], "no stale engine left anywhere"
        both = [s for s in sampler.samples if len(s) > 1]
        assert both == [], f"the router was given both the stale and the new replica: {both[:3]}"
        assert any(net.addr[other] in u for s in sampler.samples for u in s)
        assert "lost" in f.server.output(10 ** 8)


def test_sixty_percent_of_nodes_cut_off_is_damped_nothing_lost_nothing_moved_and_all_back_after_the_heal(tmp_path):
    names = ["a", "b", "c", "d", "e"]
    with Network(names) as net, netns_fleet(tmp_path, net, {n: 1 for n in names}, replicas=3,
                                           lifecycle=LIFECYCLE) as f:
        f.start()
        before = {r["replica_id"]: shard_of(r)["process"] for r in f.wait_ready(3)}
        busy = sorted(n for n, nid in f.node_ids.items()
                      if any(shard_of(r)["node_id"] == nid for r in f.ready_replicas()))
        cut = busy[:2] + [n for n in names if n not in busy][:1]  # 3 of 5: two serving nodes and an idle one
        placed = f.server.output(10 ** 8).count(": placed (")
        for n in cut:
            net.cut(n)
        until(lambda: all((f.try_node(n) or {}).get("state") == "unreachable" for n in cut), "3 nodes unreachable",
              on_timeout=f.dump)
        silent_since = time.monotonic()
        until(lambda: time.monotonic() - silent_since > LIFECYCLE["lost_after"] + 2, "lost_after to pass in silence",
              interval=0.5)
        nodes = f.get("/v1/nodes")
        assert nodes["fleet"]["damped"] is True, nodes["fleet"]
        assert not any(n["state"] == "lost" for n in nodes["nodes"]), [n["state"] for n in nodes["nodes"]]
        assert {r["replica_id"]: shard_of(r)["process"] for r in f.replicas()["replicas"]} == before, \
            "nothing moved while damped"
        for n in cut:
            net.heal(n)
        until(lambda: all(n["state"] == "ready" and n["connected"] for n in f.nodes().values()), "all nodes back",
              on_timeout=f.dump)
        after = {r["replica_id"]: shard_of(r)["process"] for r in f.wait_ready(3)}
        assert after == before, "the same engines serve after the heal"
        assert sorted(f.engine_pids()) == sorted(p["pid"] for p in before.values())
        assert all(len(v) == 1 for v in gpu_owners(f.replicas()).values())
        assert f.server.output(10 ** 8).count(": placed (") == placed, "nothing was placed during or after the cut"


def test_200ms_latency_and_5_percent_loss_on_every_stream_make_no_node_flap(tmp_path):
    """netem where the kernel has it; else real random loss (nftables) and a relay holding the
    stream's bytes 200 ms each way, which is harsher than netem's one-way 200 ms."""
    names = ["a", "b"]
    netem = netem_unavailable() is None
    with Network(names) as net, netns_fleet(tmp_path, net, {n: 1 for n in names}, replicas=2,
                                           lifecycle=LIFECYCLE) as f, \
            DelayRelay(net.host, (net.host, f.port), 0.2) as relay:
        if not netem:
            for agent in f.agents.values():
                edit_agent_config(agent, lambda doc: doc["control_plane"].update(
                    url=f"wss://{net.host}:{relay.address[1]}/v1/agent/stream"))
        f.start()
        before = {r["replica_id"]: shard_of(r)["process"] for r in f.wait_ready(2)}
        for n in names:
            why = net.impair(n, "delay", "200ms", "loss", "5%") if netem else net.lose(n, 5)
            if why is not None:
                pytest.skip(f"cannot impair the link here: {why}")
        log_from = len(f.server.output(10 ** 8))
        time.sleep(20)  # an observation window: with unreachable_after 3 s, a flap would show many times over
        after = {r["replica_id"]: shard_of(r)["process"] for r in f.wait_ready(2)}
        assert after == before
        log = f.server.output(10 ** 8)[log_from:]
        assert "-> unreachable" not in log and "stream closed" not in log, log[-3000:]
        assert netem or relay.connections == len(names), "every stream went through the delay"
