"""A real ``llmgw server`` leading on a real etcd, its event loop held as a long CPU-bound pass holds it.

Held longer than its lease, it keeps the lead (the lease is renewed from a
thread of its own: etcd sees it renewed while the loop is held, and the same
term leads afterwards).  Held past ``ha.max_loop_stall``, it is taken for
wedged: the renewals stop, the lease lapses at etcd, and once the loop runs
again the process has stopped leading and exits (status 3) to start again as
a standby.  The loop is held through the test-only hook (``loophold``:
SIGUSR2 with ``LLMGW_TEST_HOLD_LOOP``), not SIGSTOP, which would stop the
renewal thread too.
"""

from __future__ import annotations

import json
import signal
import time

import pytest

from etcdproc import Etcd
from fleet import Fleet, role, until
from llmgw.controlplane.etcd import BlockingEtcd
from llmgw.controlplane.loophold import HOLD_ENV

pytestmark = pytest.mark.integration

TTL, RENEW, MAX_STALL = 2, 0.5, 6.0


def leader_key(etcd: BlockingEtcd):
    return etcd.get("/llmgw/leader")


def lease_ttl_left(etcd: BlockingEtcd, lease: int) -> int:
    """Seconds etcd gives the lease still (-1 once it lapsed)."""
    return int(etcd.call("/v3/lease/timetolive", {"ID": str(lease)}).get("TTL", -1))


def test_a_held_loop_keeps_the_lead_and_a_wedged_one_loses_it(tmp_path, monkeypatch):
    hold = tmp_path / "hold"
    monkeypatch.setenv(HOLD_ENV, str(hold))
    with Etcd(tmp_path / "etcd") as etcd_proc, Fleet(tmp_path / "fleet", nodes={}, replicas=0) as f:
        etcd = BlockingEtcd((etcd_proc.url,))
        try:
            f.config["ha"] = {"etcd": {"endpoints": [etcd_proc.url]}, "lease_ttl": TTL, "renew_interval": RENEW,
                              "max_loop_stall": MAX_STALL, "name": "cp1", "advertise_url": f.url}
            f.write_config()
            f.server.start()
            until(lambda: role(f, f.url) == "leader", "cp1 to lead", on_timeout=f.server.output)
            term = leader_key(etcd)
            assert term is not None and json.loads(term.value)["name"] == "cp1"
            holds = [0]

            def held() -> float:
                """Hold the loop; return once the server says it holds it."""
                hold.touch()
                f.server.signal(signal.SIGUSR2)
                until(lambda: f.server.life_output().count("holding the event loop") > holds[0],
                      "the server to hold its loop", on_timeout=f.server.output)
                holds[0] += 1
                return time.monotonic()

            # 1. held longer than the lease lives: etcd sees the lease renewed meanwhile, and the term goes on
            since = held()
            until(lambda: time.monotonic() - since > TTL + RENEW, "the hold to outlast the lease", timeout=TTL + 30)
            assert lease_ttl_left(etcd, term.lease) > 0, "the lease was renewed while the loop was held"
            hold.unlink()
            until(lambda: "released the event loop" in f.server.life_output(), "the loop to run again",
                  on_timeout=f.server.output)
            assert role(f, f.url) == "leader"
            assert leader_key(etcd) == term, "the same term leads: nobody was deposed"
            assert f.server.alive() and "stepping down" not in f.server.life_output()

            # 2. held past max_loop_stall: taken for wedged, the lease lapses at etcd, and the woken leader exits
            held()
            until(lambda: leader_key(etcd) is None, "the wedged leader's lease to lapse at etcd",
                  timeout=MAX_STALL + TTL + 30, on_timeout=f.server.output)
            assert lease_ttl_left(etcd, term.lease) < 0
            assert "no longer renewing the lease" in f.server.life_output()
            hold.unlink()
            until(lambda: not f.server.alive(), "the woken leader to exit", on_timeout=f.server.output)
            assert f.server.proc.returncode == 3
            out = f.server.life_output()
            assert "no longer the leader" in out and "stepping down as leader" in out
        finally:
            hold.unlink(missing_ok=True)  # a failure must not leave the loop held: the server could not stop
