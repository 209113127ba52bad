"""The fetcher inside the agent: real Supervisor, real launches, a real weights server.

Each test drives one ``Supervisor`` on its own loop and reads the messages
it emits, as the stream would carry them (every one must pass the stream
schema).  Engines are ``sh -c 'exec sleep 60'``: a real process launched
through the real vLLM adapter with the fetched path in its argv, that never
answers, so a shard stays ``starting`` for as long as a test needs.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest
from fetch_agent import Agent, WAIT

from llmgw.settings import FetchPolicy

from supervisor_harness import make_spec
from fetch_support import WeightsServer

pytestmark = pytest.mark.integration

MIB = 1 << 20


def spec(i: int, url: str, timeout: float = 120) -> dict:
    """Shard ``i`` of its own replica on GPU ``i``: eight shards of one node, one source."""
    return make_spec(f"big.sim.{i}-x/r0", source=url, gpus=(i,), timeout=timeout)


def test_eight_shards_starting_together_make_exactly_one_get_and_all_launch_on_its_file(tmp_path):
    data = random.Random(11).randbytes(4 * MIB)

    async def main(srv: WeightsServer) -> None:
        a = Agent(tmp_path, FetchPolicy(progress_interval=0.02))
        try:
            url = srv.url("org/model.safetensors")
            for i in range(8):
                a.sup.start(spec(i, url))
            sids = [f"big.sim.{i}-x/r0" for i in range(8)]
            await a.until(lambda: all("starting" in a.states(s) for s in sids), "all eight starting")
            assert srv.files["org/model.safetensors"].gets == 1
            paths = {a.sup.shards[s].argv[a.sup.shards[s].argv.index("serve") + 1] for s in sids}
            (path,) = paths
            assert Path(path).read_bytes() == data
            for s in sids:
                assert a.states(s)[:3] == ["pending", "fetching", "starting"]
            named = set().union(*(m.get("shard_ids", []) for m in a.progress))
            assert named == set(sids)  # watchers keyed by source: every waiter hears of the one download
        finally:
            await a.close()

    with WeightsServer() as srv:
        srv.add("org/model.safetensors", data, trickle=(512 << 10, 0.01))
        asyncio.run(main(srv))


def test_a_failed_fetch_fails_every_waiting_shard_with_the_reason(tmp_path):
    async def main(srv: WeightsServer) -> None:
        a = Agent(tmp_path, FetchPolicy())
        try:
            url = srv.url("org/nothing.safetensors")
            for i in range(3):
                a.sup.start(spec(i, url))
            sids = [f"big.sim.{i}-x/r0" for i in range(3)]
            await a.until(lambda: all("failed" in a.states(s) for s in sids), "all three failed")
            for s in sids:
                last = [m for m in a.status if m["shard_id"] == s][-1]
                assert last["reason"] == f"fetching {url}: HTTP 404 Not Found"
                assert a.states(s) == ["pending", "fetching", "failed"]
        finally:
            await a.close()

    with WeightsServer() as srv:
        asyncio.run(main(srv))


def test_ten_thousand_progress_reports_cause_no_transition_and_the_start_timeout_still_fires(tmp_path):
    """Progress never moves the start deadline.

    Lockstep: the server makes its next write only after the agent has reported the last one,
    so there is exactly one progress message per write, and the reports keep coming for as long
    as the download runs.  The file is far larger than can arrive that way, and the server is
    told to stop writing only at 3x start_timeout.  A deadline that progress pushed back could
    therefore only fire after the reports had stopped; this one must fire while they still flow,
    after 10,000 of them, with not one state change between ``fetching`` and ``failed``.
    """
    n = 10_000
    start_timeout = 10.0
    data = random.Random(12).randbytes(16 * MIB)  # 64-byte writes: 262,144 reports to finish

    async def main(srv: WeightsServer) -> None:
        a = Agent(tmp_path, FetchPolicy(progress_interval=0, stall_timeout=600, attempts=1))
        a.on_progress = lambda k: srv.allow("slow/model.safetensors", k)  # report k lets write k go
        loop = asyncio.get_running_loop()
        source_stopped: list[float] = []

        def stop_source() -> None:
            srv.hold("slow/model.safetensors")
            source_stopped.append(time.monotonic())

        try:
            sid = "big.sim.0-x/r0"
            t0 = time.monotonic()
            a.sup.start(spec(0, srv.url("slow/model.safetensors"), timeout=start_timeout))
            loop.call_later(3 * start_timeout, stop_source)
            await a.until(lambda: "failed" in a.states(sid), "the start timeout", timeout=WAIT)
            whats = [what for _, what in a.order]
            i_fetching, i_failed = whats.index("fetching"), whats.index("failed")
            failed_at = a.order[i_failed][0]
            reason = a.status[-1]["reason"]
            assert reason.startswith(f"not ready within start_timeout ({start_timeout:g}s): still fetching ")
            # It fired while the progress source was still running, on an unfinished download ...
            assert not source_stopped, f"failed only after the progress source stopped ({failed_at - t0:.1f}s in)"
            assert a.progress[-1]["bytes_done"] < len(data)
            # ... with reports still arriving in the last quarter of the start window (no lull let it fire) ...
            assert any(t >= t0 + 0.75 * start_timeout for t, what in a.order if what == "progress" and t < failed_at)
            # ... and never before the deadline.
            assert failed_at - t0 >= start_timeout
            # 10,000+ reports between fetching and failed, and 0 transitions caused by them.
            between = whats[i_fetching + 1:i_failed]
            assert between.count("progress") >= n, between.count("progress")
            assert [w for w in between if w != "progress"] == []
            assert a.states(sid) == ["pending", "fetching", "failed"]
        finally:
            await a.close()

    with WeightsServer() as srv:
        srv.add("slow/model.safetensors", data, chunk=64, lockstep=len(data))
        asyncio.run(main(srv))
