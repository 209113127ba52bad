"""Two control planes on a three-member etcd, a real agent, engines and a standalone router under load.

Lose one etcd member (the one the leader asks first, which is also raft's
leader): the control-plane leadership holds, or moves within the lease plus
5 s, and nothing that serves notices.  Cut the leader from every member (its
endpoints go through relays that start swallowing bytes): it steps down
before its lease can lapse at etcd, and the standby, which still reaches
etcd, takes over once it has; no command from the old term is acted on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from etcdproc import CutRelay, EtcdCluster
from fleet import (Fleet, Proc, edit_agent_config, free_port, gpu_owners, llmgw_argv, role, router_endpoints,
                   shard_identities, standalone_router, until)
from openai_load import LOAD_PROFILE, StreamingLoad

pytestmark = pytest.mark.integration

TTL, RENEW = 3, 0.5


def control_plane(f: Fleet, name: str, endpoints: list[str]) -> tuple[Proc, str]:
    """A control plane on this fleet's configuration, with its own port, name and etcd endpoints."""
    port = free_port()
    url = f"https://127.0.0.1:{port}"
    cfg = yaml.safe_load(f.config_path.read_text())
    cfg["api"]["listen"]["port"] = port
    cfg["ha"] = {"etcd": {"endpoints": endpoints}, "lease_ttl": TTL, "renew_interval": RENEW,
                 "name": name, "advertise_url": url}
    path = f.root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = Proc(name, llmgw_argv("server", "--config", str(path)), f.root / f"{name}.log", f.root)
    f.extra.append(proc)
    return proc, url


class Pair:
    """cp1 leading, cp2 standing by, the agent and a router following both, streams flowing."""

    def __init__(self, f: Fleet, cp1_endpoints: list[str], cp2_endpoints: list[str]):
        self.f = f
        self.cp1, self.url1 = control_plane(f, "cp1", cp1_endpoints)
        self.cp2, self.url2 = control_plane(f, "cp2", cp2_endpoints)
        streams = [u.replace("https://", "wss://") + "/v1/agent/stream" for u in (self.url1, self.url2)]
        for agent in f.agents.values():
            edit_agent_config(agent, lambda d: d["control_plane"].update(url=streams))
        self.cp1.start()
        until(lambda: role(f, self.url1) == "leader", "cp1 to lead", on_timeout=self.cp1.output)
        self.cp2.start()
        until(lambda: role(f, self.url2) == "standby", "cp2 to stand by", on_timeout=self.cp2.output)
        f.url = self.url1
        for agent in f.agents.values():
            agent.start()
        self.before = shard_identities({"replicas": f.wait_ready(2)})
        self.router, rport = standalone_router(f, extra={"control_plane": {
            "url": [self.url1, self.url2], "ca": str(f.pki.ca_cert), "cert": str(f.pki.router[0]),
            "key": str(f.pki.router[1])}})
        until(lambda: router_endpoints(rport) == 2, "the router to learn 2 endpoints", on_timeout=self.router.output)
        self.load = StreamingLoad(f"http://127.0.0.1:{rport}").start()
        until(lambda: self.load.count() >= 5, "streams flowing", on_timeout=self.router.output)

    def roles(self) -> dict[str, str | None]:
        return {"cp1": role(self.f, self.url1), "cp2": role(self.f, self.url2)}

    def watch(self, since: float, done: Callable[[list], bool]) -> list[tuple[float, dict[str, str | None]]]:
        """Both control planes' roles, sampled until ``done(samples)``: never two leaders at once."""
        samples: list[tuple[float, dict[str, str | None]]] = []

        def sample() -> bool:
            roles = self.roles()
            samples.append((time.monotonic() - since, roles))
            assert list(roles.values()).count("leader") <= 1, f"two leaders at once: {samples[-5:]}"
            return done(samples)

        until(sample, "the leadership to settle", timeout=TTL + 20, interval=0.05,
              on_timeout=lambda: f"{samples[-10:]}\n{self.cp1.output(3000)}\n{self.cp2.output(3000)}")
        return samples

    def check_nothing_moved(self, leader_url: str, leader: Proc) -> int:
        """The new (or same) leader adopted every engine: none restarted, no GPU twice, 0 failed streams."""
        f = self.f
        f.url = leader_url
        until(lambda: f.try_get("/v1/nodes") and f.get("/v1/nodes")["fleet"]["startup_grace_left_s"] == 0,
              "the failover grace to end", on_timeout=leader.output)
        replicas = f.wait_ready(2)
        assert shard_identities({"replicas": replicas}) == self.before, "0 engines restarted"
        assert all(len(s) == 1 for s in gpu_owners(f.replicas()).values())
        served = self.load.count()
        until(lambda: self.load.count() >= served + 5, "streams after the etcd fault", on_timeout=self.router.output)
        self.load.stop()
        assert self.load.failures == [], self.load.failures[:10]
        return self.load.count()


def no_leader_gap(samples: list[tuple[float, dict[str, str | None]]]) -> float:
    """The longest time no control plane answered as leader."""
    gap, last = 0.0, 0.0
    for t, roles in samples:
        if "leader" in roles.values():
            last = t
        gap = max(gap, t - last)
    return gap


def test_losing_the_etcd_member_the_leader_uses_keeps_a_leader_and_moves_nothing(tmp_path: Path):
    with EtcdCluster(tmp_path / "etcd") as etcd, Fleet(tmp_path, nodes={"a": 2}, replicas=2, profile=LOAD_PROFILE,
                                                         lifecycle={"startup_grace": 3.0}) as f:
        raft_leader = etcd.leader()
        assert raft_leader is not None
        first = [raft_leader.url] + [u for u in etcd.urls if u != raft_leader.url]  # the leader asks it first
        pair = Pair(f, first, list(reversed(first)))

        raft_leader.proc.kill()
        killed = time.monotonic()
        # settled: raft has a new leader among the two left, a full lease has passed since the kill, and a
        # control plane leads (the same one when it renewed through the election, else the standby)
        samples = pair.watch(killed, lambda s: etcd.leader() is not None and s[-1][0] > TTL + RENEW
                             and "leader" in s[-1][1].values())
        gap = no_leader_gap(samples)
        assert gap <= TTL + 5, f"no leader for {gap:.1f}s after losing an etcd member"
        held = samples[-1][1]["cp1"] == "leader"
        if held:
            assert "stepping down" not in pair.cp1.output()
            streams = pair.check_nothing_moved(pair.url1, pair.cp1)
        else:  # leadership moved: the old leader exited to stand by again, the standby leads
            until(lambda: not pair.cp1.alive(), "cp1 to exit", on_timeout=pair.cp1.output)
            assert pair.cp1.proc.returncode == 3
            streams = pair.check_nothing_moved(pair.url2, pair.cp2)
        print(f"etcd raft leader (cp1's first endpoint) killed: leadership {'held' if held else 'moved'}, "
              f"longest time without a leader {gap:.2f}s (lease {TTL}s); {streams} streams, 0 failed")


def test_a_leader_cut_from_etcd_steps_down_before_its_lease_lapses_and_the_standby_takes_over(tmp_path: Path):
    with EtcdCluster(tmp_path / "etcd") as etcd, Fleet(tmp_path, nodes={"a": 2}, replicas=2, profile=LOAD_PROFILE,
                                                         lifecycle={"startup_grace": 3.0}) as f:
        relays = [CutRelay(u) for u in etcd.urls]
        for r in relays:
            r.__enter__()
        try:
            pair = Pair(f, [r.url for r in relays], etcd.urls)
            before = len(pair.cp1.output(last=1 << 30))
            for r in relays:
                r.cut()
            cut = time.monotonic()
            stepped = until(lambda: "stepping down" in pair.cp1.output(last=1 << 30)[before:] and time.monotonic(),
                            "cp1 to step down", timeout=TTL + 5, interval=0.02, on_timeout=pair.cp1.output)
            stepped_after = stepped - cut
            samples = pair.watch(cut, lambda s: s[-1][1]["cp2"] == "leader")
            took = samples[-1][0]
            until(lambda: not pair.cp1.alive(), "cp1 to exit", on_timeout=pair.cp1.output)
            assert pair.cp1.proc.returncode == 3
            cut_life = pair.cp1.life_output()
            tail = cut_life[cut_life.index("stepping down"):]
            assert "start for" not in tail and "placed (" not in tail, "a leader that stepped down dispatches nothing"
            # it stopped leading before the lease could lapse at etcd: the standby's campaign succeeded only
            # after the lapse, so every moment had at most one leader (watch() asserts it at every sample)
            assert stepped_after < TTL, f"stepped down {stepped_after:.2f}s after the cut; the lease lives {TTL}s"
            assert took <= TTL + 5
            streams = pair.check_nothing_moved(pair.url2, pair.cp2)
            for agent in f.agents.values():
                assert "deposed control-plane leader" not in agent.output()
        finally:
            for r in relays:
                r.__exit__(None, None, None)
        print(f"leader cut from etcd: stepped down {stepped_after:.2f}s after the cut, standby leading "
              f"{took:.2f}s after it (lease {TTL}s, renew {RENEW}s); {streams} streams, 0 failed")
