"""Two control planes on one etcd, a real agent, engines and a standalone router under streaming load.

SIGKILL the leader: the standby takes over within the lease (plus 5 s), the
agent follows it, its engines are adopted (none restarted) and no request
fails.  SIGSTOP a leader past its lease and wake it: it has stopped leading
before it can act, and exits to start again as a standby.
"""

from __future__ import annotations

import re
import signal
import time

import httpx
import pytest
import yaml

from etcdproc import Etcd
from fleet import (Fleet, Proc, edit_agent_config, free_port, llmgw_argv, role, router_endpoints, shard_identities,
                   standalone_router, until)
from llmgw.tls import client_context
from openai_load import LOAD_PROFILE, StreamingLoad

pytestmark = pytest.mark.integration

TTL, RENEW = 3, 0.5


def second_server(f: Fleet, etcd: Etcd, name: str) -> tuple[Proc, str]:
    port = free_port()
    url = f"https://127.0.0.1:{port}"
    cfg = yaml.safe_load(f.config_path.read_text())
    cfg["api"]["listen"]["port"] = port
    cfg["ha"] = {**cfg["ha"], "name": name, "advertise_url": url}
    path = f.root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = Proc(name, llmgw_argv("server", "--config", str(path)), f.root / f"{name}.log", f.root)
    f.extra.append(proc)
    return proc, url


def test_the_standby_takes_over_a_killed_leader_and_a_woken_leader_cannot_act(tmp_path):
    with Etcd(tmp_path / "etcd") as etcd, Fleet(tmp_path, nodes={"a": 2}, replicas=2, profile=LOAD_PROFILE,
                                                 lifecycle={"startup_grace": 3.0}) as f:
        f.config["ha"] = {"etcd": {"endpoints": [etcd.url]}, "lease_ttl": TTL, "renew_interval": RENEW,
                          "name": "cp1", "advertise_url": f.url}
        f.write_config()
        url1 = f.url
        cp2, url2 = second_server(f, etcd, "cp2")
        stream2 = url2.replace("https://", "wss://") + "/v1/agent/stream"
        for agent in f.agents.values():
            edit_agent_config(agent, lambda d: d["control_plane"].update(url=[f.stream_url, stream2]))
        f.server.start()
        until(lambda: role(f, url1) == "leader", "cp1 to lead", on_timeout=f.server.output)
        cp2.start()
        until(lambda: role(f, url2) == "standby", "cp2 to stand by", on_timeout=cp2.output)
        for agent in f.agents.values():
            agent.start()
        before = shard_identities({"replicas": f.wait_ready(2)})
        # the standby holds no authority: admin writes go to the leader, the watch says "keep what you have"
        with httpx.Client(base_url=url2, verify=client_context(f.pki.ca_cert, *f.pki.admin), timeout=5) as c:
            r = c.post(f"/v1/nodes/{f.node_ids['a']}/cordon")
            assert r.status_code == 307 and r.headers["Location"] == f"{url1}/v1/nodes/{f.node_ids['a']}/cordon"
            assert c.get("/v1/router/endpoints").status_code == 503
        router, rport = standalone_router(f, extra={"control_plane": {
            "url": [url1, url2], "ca": str(f.pki.ca_cert), "cert": str(f.pki.router[0]), "key": str(f.pki.router[1])}})
        until(lambda: router_endpoints(rport) == 2, "the router to learn 2 endpoints", on_timeout=router.output)
        load = StreamingLoad(f"http://127.0.0.1:{rport}").start()
        until(lambda: load.count() >= 5, "streams flowing", on_timeout=router.output)

        # SIGKILL the leader: the standby leads within the lease, plus 5 s
        f.server.kill()
        killed = time.monotonic()
        until(lambda: role(f, url2) == "leader", "cp2 to take over", timeout=TTL + 5, interval=0.05,
              on_timeout=cp2.output)
        took = time.monotonic() - killed
        f.url = url2  # the fleet's API is the new leader's
        until(lambda: f.try_get("/v1/nodes") and f.get("/v1/nodes")["fleet"]["startup_grace_left_s"] == 0,
              "the failover grace to end", on_timeout=cp2.output)
        after = shard_identities({"replicas": f.wait_ready(2)})
        assert after == before, "0 engines restarted: the new leader adopted what runs"
        served = load.count()
        until(lambda: load.count() >= served + 5, "streams after the takeover", on_timeout=router.output)
        until(lambda: any("2 endpoint(s) at revision" in line and url2 in line
                          for line in router.output().splitlines()),
              "the router to follow the new leader", on_timeout=router.output)
        assert took <= TTL + 5
        # whole logs, not output()'s tail: a takeover on a slow host logs its etcd calls long after the line
        taken_over = cp2.output(last=1 << 30)
        assert "leading as term" in taken_over
        # the agent took the standby's refusals as a control plane that is up: it waited as told and
        # its backoff never grew past the start (else it could sleep reconnect_max past the takeover)
        for agent in f.agents.values():
            log = agent.output(last=1 << 30)
            assert "is a standby" in log, log[-3000:]
            grown = [int(m) for m in re.findall(r"reconnecting to \S+ in [0-9.]+s \(attempt (\d+)\)", log)]
            assert max(grown, default=0) <= 2, grown
        taken_over = cp2.output(last=1 << 30)
        assert ": placed (" not in taken_over and "stopping" not in taken_over

        # the old leader comes back as a standby; then the new leader is paused past its lease
        f.server.start()
        until(lambda: role(f, url1) == "standby", "cp1 to stand by", on_timeout=f.server.output)
        cp2.signal(signal.SIGSTOP)
        try:
            until(lambda: role(f, url1) == "leader", "cp1 to take over from the paused leader",
                  timeout=TTL + 5, interval=0.05, on_timeout=f.server.output)
        finally:
            cp2.signal(signal.SIGCONT)
        until(lambda: not cp2.alive(), "the woken leader to exit", on_timeout=cp2.output)
        assert cp2.proc.returncode == 3
        woke = cp2.life_output()
        assert "no longer the leader" in woke
        tail = woke[woke.index("stepping down"):]
        assert "start for" not in tail and "placed (" not in tail, "a woken leader dispatches nothing"
        f.url = url1
        until(lambda: f.try_get("/v1/nodes") and f.get("/v1/nodes")["fleet"]["startup_grace_left_s"] == 0,
              "the failover grace to end", on_timeout=f.server.output)
        assert shard_identities({"replicas": f.wait_ready(2)}) == before
        load.stop()
        assert load.failures == [], load.failures[:10]
        f.server.terminate()  # a clean stop gives the lead up and is not a deposition
        assert f.server.proc.returncode == 0 and "giving the lead up" in f.server.life_output()
        print(f"takeover after SIGKILL: {took:.2f}s (lease {TTL}s); {load.count()} streams, 0 failed")
