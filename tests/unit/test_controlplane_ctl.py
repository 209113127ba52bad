"""``llmgw ctl`` tables: what an operator reads for each replica and node state."""

from __future__ import annotations

import argparse

import pytest

from llmgw.ctl.fleet import CtlError, format_nodes, format_replicas, make_client, progress_line


def shard(**kw):
    base = {"shard_id": "tiny.sim.0-aa/r0", "rank": 0, "node_id": "gpu-1", "gpus": [0, 1], "state": "ready",
            "reason": None, "output_tail": None, "pid": 4242, "port": 20001, "adopted": False, "progress": None}
    return {**base, **kw}


def replica(**kw):
    base = {"replica_id": "tiny.sim.0-aa", "model": "tiny", "profile": "sim", "slot": 0, "state": "ready",
            "reason": None, "adopted": False, "age_s": 75, "restarts": 0, "endpoint": "http://10.0.0.1:20001",
            "retry_in_s": None, "last_failure": None, "shards": [shard()]}
    return {**base, **kw}


def test_downloading_replica_gets_a_progress_line_and_no_invented_percentage():
    doc = {"replicas": [replica(state="starting", shards=[shard(state="fetching", progress={
        "source": "https://h/m.gguf", "file": "m.gguf", "bytes_done": 3 << 30, "bytes_total": 12 << 30,
        "rate_bps": 100 << 20})])]}
    lines = format_replicas(doc)
    assert lines[0].split()[:3] == ["REPLICA", "MODEL/PROFILE", "STATE"]
    (prog,) = [line for line in lines if "downloading" in line]
    assert prog.strip() == "downloading m.gguf  3.0 GiB / 12.0 GiB  25%  100 MiB/s  ETA 1m32s"
    assert progress_line({"source": "s", "bytes_done": 5 << 20, "bytes_total": None}) == "downloading s  5.0 MiB so far"


def test_failed_replica_shows_reason_retry_and_output_tail():
    tail = "".join(f"line {i}\n" for i in range(30))
    doc = {"replicas": [replica(state="failed", reason="shard r0 on gpu-1 failed: not ready within start_timeout (5s)",
                                retry_in_s=12.2, shards=[shard(state="failed", reason="not ready within start_timeout (5s)",
                                                               output_tail=tail)])]}
    text = "\n".join(format_replicas(doc))
    assert "failed: shard r0 on gpu-1 failed: not ready within start_timeout (5s) (next attempt in 12s)" in text
    assert "reason: not ready within start_timeout (5s)" in text
    assert "| line 29" in text and "| line 10" in text and "| line 9\n" not in text
    assert "(10 earlier lines)" in text


def test_unplaced_slot_and_nodes_notes():
    doc = {"replicas": [], "unplaced": [{"model": "tiny", "profile": "sim", "slot": 1,
                                         "reason": "no placement for tiny/sim (1 GPU on one node): 1 node: 1 lost",
                                         "last_failure": {"replica_id": "tiny.sim.1-bb", "reason": "node gpu-2 lost"}}]}
    text = "\n".join(format_replicas(doc))
    assert "tiny/sim#1: not placed: no placement" in text and "node gpu-2 lost" in text
    nodes = {"nodes": [{"node_id": "gpu-2", "state": "lost", "connected": False, "gpus_free": 8, "gpus_total": 8,
                        "address": "10.0.0.2", "agent_version": "0.1.0", "last_seen_s": 130, "epoch": 3,
                        "reason": "silent for 121.0s (lost_after 120s)"}],
             "fleet": {"hold_reason": None, "startup_grace_left_s": 0}}
    text = "\n".join(format_nodes(nodes))
    assert "lost (disconnected)" in text and "gpu-2: lost (silent for 121.0s (lost_after 120s))" in text


def test_client_requires_url_ca_and_credentials(monkeypatch):
    for k in ("LLMGW_URL", "LLMGW_CA", "LLMGW_CERT", "LLMGW_KEY", "LLMGW_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    ns = argparse.Namespace(url=None, ca=None, cert=None, key=None, token=None, timeout=5)
    with pytest.raises(CtlError, match="--url"):
        make_client(ns)
    ns.url = "https://cp:8443"
    with pytest.raises(CtlError, match="--ca"):
        make_client(ns)
    monkeypatch.setenv("LLMGW_CA", "/nonexistent/ca.crt")
    ns.token = "t"
    with pytest.raises(CtlError, match="does not exist"):
        make_client(ns)


def test_routers_ejections_and_a_sick_verdict_are_shown_under_the_replica():
    ej = {"routers": [{"router": "router-a", "endpoint_id": "e", "reason": "status_5xx", "ejected_for_s": 42,
                       "consecutive_failures": 7, "ejected_now": True, "reported_ago_s": 1.2},
                      {"router": "router-b", "endpoint_id": "e", "reason": "timeout", "ejected_for_s": 30,
                       "consecutive_failures": 3, "ejected_now": False, "reported_ago_s": 0.4}],
          "verdict": "ejected by 2 routers (router-a, router-b) for over 20s", "routers_needed": 2}
    doc = {"replicas": [replica(sick="ejected by 2 routers (router-a, router-b) for over 20s", ejections=ej)]}
    text = "\n".join(format_replicas(doc))
    assert "sick: ejected by 2 routers (router-a, router-b) for over 20s; its replacement starts first" in text
    assert "ejected by 2 router(s): ejected by 2 routers" in text
    assert "router router-a: for 42s (status_5xx, 7 failures in a row; reported 1s ago)" in text
    assert "router router-b: for 30s (timeout" in text
    # a replica no router reports shows nothing of it
    assert "ejected" not in "\n".join(format_replicas({"replicas": [replica()]}))


def test_route_keys_and_the_kv_feeds_age_are_columns_and_dash_for_an_engine_that_publishes_none():
    doc = {"replicas": [replica(route_keys={"keys": 5, "resets": 1, "dropped": 0, "age_s": 12.4}),
                        replica(replica_id="tiny.llama.1-bb", profile="llama")]}
    lines = format_replicas(doc)
    assert lines[0].split()[-4:] == ["ROUTE", "KEYS", "KV", "FEED"]
    row = next(line for line in lines if line.startswith("tiny.sim.0-aa"))
    assert row.split()[-2:] == ["5", "12s"]
    row = next(line for line in lines if line.startswith("tiny.llama.1-bb"))
    assert row.split()[-2:] == ["-", "-"]
    assert "    route keys: 1 reset(s)" in lines
    doc["replicas"][0]["route_keys"].update(resets=0, dropped=7)
    assert "    route keys: 7 dropped past the cap" in format_replicas(doc)


def test_explain_says_which_replicas_feed_route_keys_and_what_each_router_made_of_them():
    from llmgw.ctl.fleet import format_explain

    running = {"replica": "tiny/sim#0", "placed": True, "running": "tiny.sim.0-aa", "state": "ready",
               "text": "tiny/sim: running", "route_keys": {"keys": 40, "resets": 1, "dropped": 0, "age_s": 3.0}}
    plain = {**running, "replica": "tiny/sim#1", "running": "tiny.sim.1-bb", "route_keys": None}
    doc = {"model": "tiny", "replicas": [running, plain]}
    text = "\n".join(format_explain(doc))
    assert "cache-aware routing: 1 of 2 running replica(s) feed route keys (40 held" in text
    assert "llmgw ctl explain tiny --router URL" in text
    mismatch = {"parity": "mismatch", "reason": "replica tiny.sim.0-aa: canned request 0: the router's token ids "
                                                "differ from the engine's from position 3 (41 ids against 42)"}
    doc["routers"] = [
        {"url": "https://r1:8080", "healthz": {"route_keys": {"age_s": 2.0}, "tokenizer_parity": {"tiny": mismatch}}},
        {"url": "https://r2:8080", "healthz": {"route_keys": {"age_s": 1.0},
                                               "tokenizer_parity": {"tiny": {"parity": "ok", "replica": "x"}}}},
        {"url": "https://r3:8080", "healthz": {"status": "ok"}},
        {"url": "https://r4:8080", "error": "ConnectError: refused"},
    ]
    lines = format_explain(doc)
    assert ("router https://r1:8080: precise routing OFF for tiny until the router restarts (prefix affinity): "
            + mismatch["reason"]) in "\n".join(lines)
    assert any(line.startswith("router https://r2:8080: precise routing on for tiny (tokenizer parity ok")
               for line in lines)
    assert "router https://r3:8080: not cache-aware" in "\n".join(lines)
    assert "router https://r4:8080: no answer (ConnectError: refused)" in lines
    assert "--router URL" not in "\n".join(lines)
    assert not any("cache-aware" in line for line in format_explain({"model": "m", "replicas": [plain]}))
