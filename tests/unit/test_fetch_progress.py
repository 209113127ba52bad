"""Progress of a download: the message, the line under the replica, and that it is never a transition."""

from __future__ import annotations

import asyncio

import pytest

from llmgw.agent.fetch.flight import FlightConflict, Flights
from llmgw.agent.fetch.progress import RateMeter, Snapshot
from llmgw.config import ConfigInvalid, schema_errors
from llmgw.controlplane.messages import parse_up
from llmgw.ctl.fleet import format_replicas, human_eta, progress_line
from llmgw.settings import FetchPolicy, parse_agent_settings

from reconciler_fleet import Fleet, catalog, starts  # the reconciler's own test fleet

GIB, MIB = 1 << 30, 1 << 20


# ------------------------------------------------------------------ message

def test_progress_message_is_valid_on_the_stream_and_has_no_invented_total():
    import json

    msg = Snapshot(3 * GIB, None, 210.0 * MIB, "stalled: no bytes for 60s; retry 1 of 4 in 2s").message(
        "https://h/m.gguf", "m.gguf", ["r/r1", "r/r0"])
    assert parse_up(json.dumps(msg)) == msg
    assert msg["bytes_total"] is None and msg["shard_ids"] == ["r/r0", "r/r1"]
    bad = {**msg, "bytes_done": -1}
    assert schema_errors(bad, "stream")


def test_rate_meter_measures_between_samples_and_smooths():
    m = RateMeter()
    assert m.sample(0.0, 0) is None
    assert m.sample(1.0, 100 * MIB) == pytest.approx(100 * MIB)
    assert m.sample(2.0, 100 * MIB) == pytest.approx(50 * MIB)  # a stalled second halves it, not zeroes it
    m.restart(10.0, 100 * MIB)  # waiting for a reconnect is not counted as zero throughput
    assert m.sample(11.0, 150 * MIB) == pytest.approx(50 * MIB)


# ------------------------------------------------------------------ ctl line

def test_progress_line_in_the_format_operators_read():
    p = {"source": "https://h/x/model.safetensors", "file": "model.safetensors",
         "bytes_done": int(12.4 * GIB), "bytes_total": 40 * GIB, "rate_bps": 210 * MIB}
    assert progress_line(p) == "downloading model.safetensors  12.4 GiB / 40.0 GiB  30%  210 MiB/s  ETA 2m15s"
    assert progress_line({**p, "bytes_total": None, "bytes_done": int(3.1 * GIB)}) == \
        "downloading model.safetensors  3.1 GiB so far  210 MiB/s"
    assert progress_line({**p, "bytes_total": None, "rate_bps": None, "bytes_done": int(3.1 * GIB)}) == \
        "downloading model.safetensors  3.1 GiB so far"
    # rounded down: 100% only when done
    assert "  99%" in progress_line({**p, "bytes_done": 40 * GIB - 1, "rate_bps": None})
    stalled = progress_line({**p, "rate_bps": None, "note": "stalled: no bytes for 60s; retry 2 of 4 in 8s"})
    assert stalled.endswith("(stalled: no bytes for 60s; retry 2 of 4 in 8s)") and "ETA" not in stalled
    assert [human_eta(s) for s in (45, 133, 3720)] == ["45s", "2m13s", "1h02m"]


def test_the_line_sits_under_the_shard_that_waits_and_nowhere_else():
    shard = {"shard_id": "t.s.0-aa/r0", "rank": 0, "node_id": "gpu-1", "gpus": [0], "state": "fetching",
             "reason": None, "output_tail": None, "pid": None, "port": None, "adopted": False,
             "progress": {"file": "m.gguf", "bytes_done": MIB, "bytes_total": None, "rate_bps": None}}
    doc = {"replicas": [{"replica_id": "t.s.0-aa", "model": "t", "profile": "s", "slot": 0, "state": "starting",
                         "reason": None, "age_s": 5, "restarts": 0, "endpoint": None, "retry_in_s": None,
                         "last_failure": None, "shards": [shard, {**shard, "rank": 1, "state": "ready",
                                                                  "progress": None}]}]}
    lines = format_replicas(doc)
    i = next(n for n, line in enumerate(lines) if "fetching" in line)
    assert lines[i + 1] == "      downloading m.gguf  1.0 MiB so far"
    assert sum("downloading" in line for line in lines) == 1


# --------------------------------------------------- control plane: not a transition

def test_ten_thousand_progress_reports_on_a_starting_shard_cause_no_transition():
    f = Fleet("a", gpus=1)
    cat = catalog(replicas=1)
    (start,) = starts(f.step(cat, now=1000.0))
    sid = start.spec["shard_id"]
    f.rec.observe_status("a", {"type": "shard_status", "shard_id": sid, "state": "starting"}, 1001.0)
    shard = f.rec.book.find("a", sid)
    since = shard.state_since
    source = start.spec["model"]["source"]
    for i in range(10_000):
        f.rec.observe_progress("a", {"type": "progress", "source": source, "bytes_done": i, "bytes_total": 10_000},
                               1001.0 + i / 100)
    assert shard.state == "starting" and shard.state_since == since
    assert shard.progress["bytes_done"] == 9_999
    # and reconciling meanwhile starts nothing new and stops nothing
    plan = f.step(cat, now=1100.0)
    assert not plan.actions
    # a real transition clears it; a late report does not bring it back under a serving shard
    f.rec.observe_status("a", {"type": "shard_status", "shard_id": sid, "state": "ready", "port": 20001,
                               "process": {"pid": 1, "start_time": 1, "boot_id": "b"}}, 1101.0)
    assert shard.progress is None
    f.rec.observe_progress("a", {"type": "progress", "source": source, "bytes_done": 9_999,
                                 "bytes_total": 10_000, "shard_ids": [sid]}, 1102.0)
    assert shard.progress is None


# ------------------------------------------------------------------ settings

def test_fetch_settings_have_defaults_and_are_checked():
    base = {"node_id": "n1", "control_plane": {"url": "ws://cp:1/v1/agent/stream"}, "state_dir": "/tmp/s",
            "insecure_no_tls": True}
    assert parse_agent_settings(base).fetch == FetchPolicy()
    s = parse_agent_settings({**base, "fetch": {"stall_timeout": 5, "attempts": 2, "progress_interval": 0}})
    assert (s.fetch.stall_timeout, s.fetch.attempts, s.fetch.progress_interval) == (5, 2, 0)
    with pytest.raises(ConfigInvalid) as e:
        parse_agent_settings({**base, "fetch": {"backoff_initial": 10, "backoff_max": 1, "stall_timeout": 0}})
    text = str(e.value)
    assert "/fetch/stall_timeout" in text


# ------------------------------------------------------------------ single flight

def test_single_flight_one_run_many_watchers_one_result_and_one_error():
    async def main():
        reg, runs, got = Flights(), [], []
        gate = asyncio.Event()

        async def run(flight):
            runs.append(flight.key)
            flight.publish(Snapshot(5, 10, None))
            await gate.wait()
            return "/models/m"

        waiters = [asyncio.create_task(reg.join(("u", "/p"), "m", None, f"s{i}", got.append, run)) for i in range(8)]
        await asyncio.sleep(0.01)
        gate.set()
        paths = await asyncio.gather(*waiters)
        assert paths == ["/models/m"] * 8 and len(runs) == 1 and reg.started == 1

        async def boom(flight):
            await asyncio.sleep(0.01)
            raise RuntimeError("HTTP 404 Not Found")

        errs = await asyncio.gather(*[reg.join(("u2", "/p2"), "m", None, f"s{i}", got.append, boom)
                                      for i in range(8)], return_exceptions=True)
        assert [str(e) for e in errs] == ["HTTP 404 Not Found"] * 8 and reg.started == 2
        with pytest.raises(FlightConflict):
            gate2 = asyncio.Event()

            async def slow(flight):
                await gate2.wait()
                return "x"

            t = asyncio.create_task(reg.join(("u3", "/p3"), "m", "a" * 64, "s0", got.append, slow))
            await asyncio.sleep(0)
            try:
                await reg.join(("u3", "/p3"), "m", "b" * 64, "s1", got.append, slow)
            finally:
                gate2.set()
                await t

    asyncio.run(main())


def test_a_watcher_leaving_leaves_alone_and_the_last_one_cancels_the_download():
    async def main():
        reg, cancelled = Flights(), asyncio.Event()
        gate = asyncio.Event()

        async def run(flight):
            try:
                await gate.wait()
                return "/m"
            except asyncio.CancelledError:
                cancelled.set()
                raise

        a = asyncio.create_task(reg.join(("u", "/p"), "m", None, "a", lambda m: None, run))
        b = asyncio.create_task(reg.join(("u", "/p"), "m", None, "b", lambda m: None, run))
        await asyncio.sleep(0.01)
        a.cancel()
        await asyncio.sleep(0.01)
        assert not cancelled.is_set() and not b.done()
        b.cancel()
        await asyncio.wait_for(cancelled.wait(), 5)
        assert not reg.active

    asyncio.run(main())


def test_a_start_during_a_stopping_download_waits_for_it_to_end_and_starts_its_own():
    """The last watcher left, the download is being stopped (its fetch process killed and reaped), and a new
    shard wants the same source at that moment: it must get a download of its own, not the stopped one's
    cancellation (which left it 'fetching' for ever)."""
    async def main():
        reg, reaped, runs = Flights(), asyncio.Event(), []

        async def run(flight):
            runs.append(flight)
            if len(runs) > 1:
                return "/m"
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                await reaped.wait()  # e.g. waiting for the killed fetch process
                raise

        a = asyncio.create_task(reg.join(("u", "/p"), "m", None, "a", lambda m: None, run))
        await asyncio.sleep(0.01)
        a.cancel()
        await asyncio.sleep(0.01)
        assert ("u", "/p") in reg.active  # still stopping
        b = asyncio.create_task(reg.join(("u", "/p"), "m", None, "b", lambda m: None, run))
        await asyncio.sleep(0.01)
        reaped.set()
        assert await asyncio.wait_for(b, 5) == "/m"
        assert len(runs) == 2 and not reg.active

    asyncio.run(main())
