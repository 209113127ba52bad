"""Simulated shards go through the agent's own supervisor: real states, real messages, timed steps."""

from __future__ import annotations

import asyncio
from typing import Any

from llmgw.agent.schema import definition_problems
from llmgw.sim.fleet.shards import SYNTHETIC_PID, Counters, EngineSample, SimSupervisor, Timings, supervisor_config


def spec(shard: str = "r1/r0", rank: int = 0, nnodes: int = 1, timeout: float = 60.0,
         gpus: tuple[int, ...] = (0, 1)) -> dict[str, Any]:
    return {"shard_id": shard, "replica_id": shard.split("/")[0], "rank": rank, "nnodes": nnodes,
            "gpu_indices": list(gpus), "env": {}, "master_addr": None, "master_port": None,
            "model": {"name": "tiny", "source": "org/tiny", "served_name": "tiny", "size_bytes": 1000,
                      "sha256": None, "max_model_len": None},
            "profile": {"name": "p", "engine": "vllm", "tensor_parallel_size": 2, "pipeline_parallel_size": 1,
                        "nodes": nnodes, "extra_args": [], "env": {}, "start_timeout": timeout,
                        "max_concurrency": None}}


def make(timings: Timings) -> tuple[SimSupervisor, list[dict[str, Any]], Counters]:
    sent: list[dict[str, Any]] = []
    counters = Counters()
    sup = SimSupervisor(supervisor_config("sim-00000", ("/bin/false",), "/nonexistent", (40000, 40099)),
                        sent.append, timings, counters, EngineSample(0, (), None))
    return sup, sent, counters


def states(sent: list[dict[str, Any]]) -> list[str]:
    return [m["state"] for m in sent if m["type"] == "shard_status"]


def valid(sent: list[dict[str, Any]]) -> None:
    for m in sent:
        assert definition_problems(m["type"], m) == [], m


async def settle(sup: SimSupervisor) -> None:
    tasks = [t for s in sup.shards.values() for t in (s.lifecycle, s.stopper) if t is not None]
    await asyncio.gather(*tasks, return_exceptions=True)


def test_a_start_fetches_with_progress_then_starts_then_is_ready() -> None:
    async def run():
        sup, sent, counters = make(Timings(fetch=0.05, start=0.01, progress_interval=0.01))
        sup.start(spec())
        await settle(sup)
        return sup, sent, counters
    sup, sent, counters = asyncio.run(run())
    assert states(sent) == ["pending", "fetching", "starting", "ready"]
    progress = [m for m in sent if m["type"] == "progress"]
    assert len(progress) >= 2 and progress[-1]["bytes_done"] == progress[-1]["bytes_total"] == 1000
    assert all(m["shard_ids"] == ["r1/r0"] for m in progress)
    ready = sent[-1]
    assert ready["process"]["pid"] >= SYNTHETIC_PID and ready["port"] and ready["master_port"] is None
    report = sup.reports()[0]
    assert report["state"] == "ready" and report["port"] == ready["port"]
    assert counters.starts == 1 and counters.replicas == {"r1"}
    valid(sent)


def test_rank_zero_of_a_multi_node_replica_reports_a_rendezvous_port() -> None:
    async def run():
        sup, sent, _ = make(Timings(start=0.01))
        sup.start(spec(nnodes=2))
        sup.start(spec("r2/r1", rank=1, nnodes=2, gpus=(2, 3)))
        await settle(sup)
        return sent
    sent = asyncio.run(run())
    starting = {m["shard_id"]: m for m in sent if m["type"] == "shard_status" and m["state"] == "starting"}
    assert starting["r1/r0"]["master_port"] and starting["r1/r0"]["port"]
    assert starting["r2/r1"]["port"] is None and starting["r2/r1"]["master_port"] is None


def test_stop_while_fetching_cancels_the_start() -> None:
    async def run():
        sup, sent, counters = make(Timings(fetch=5.0, progress_interval=0.01))
        sup.start(spec())
        await asyncio.sleep(0.05)
        await sup.stop("r1/r0", "replaced")
        await settle(sup)
        return sent, counters
    sent, counters = asyncio.run(run())
    assert states(sent) == ["pending", "fetching", "stopped"]
    assert "stopped before launch" in sent[-1]["reason"] and counters.stops == 1


def test_drain_of_a_ready_shard_drains_then_stops() -> None:
    async def run():
        sup, sent, counters = make(Timings(start=0.01, stop=0.02))
        sup.start(spec())
        await settle(sup)
        await sup.stop("r1/r0", "drain requested", drain=True)
        return sup, sent, counters
    sup, sent, counters = asyncio.run(run())
    assert states(sent) == ["pending", "starting", "ready", "draining", "stopped"]
    assert sup.reports() == [] and counters.drains == 1
    valid(sent)


def test_a_start_that_cannot_be_ready_in_time_fails_like_the_real_one() -> None:
    async def run():
        sup, sent, _ = make(Timings(start=5.0, stop=0.0))
        sup.start(spec(timeout=0.05))
        await settle(sup)
        await asyncio.sleep(0.05)
        await settle(sup)
        return sent
    sent = asyncio.run(run())
    assert states(sent) == ["pending", "starting", "failed"]
    assert "not ready within start_timeout" in sent[-1]["reason"]


def test_the_agents_own_answers_to_a_resent_start_and_an_unknown_stop() -> None:
    async def run():
        sup, sent, _ = make(Timings(start=0.01))
        sup.start(spec())
        await settle(sup)
        sup.start(spec())  # resent: re-reported, never started twice
        await sup.stop("nope/r0")
        return sup, sent
    sup, sent = asyncio.run(run())
    assert states(sent) == ["pending", "starting", "ready", "ready", "stopped"]
    assert sent[-1]["shard_id"] == "nope/r0" and "not running on this node" in sent[-1]["reason"]
    assert len(sup.live_shards()) == 1


def test_a_sampled_real_engine_that_dies_during_start_fails_with_its_output_tail(tmp_path) -> None:
    """The real path runs through the agent's process driver and the simulator's state dir alike."""
    async def run():
        sent: list[dict[str, Any]] = []
        counters = Counters()
        engine = ("sh", "-c", "echo 'CUDA out of memory'; exit 3")
        sup = SimSupervisor(supervisor_config("sim-00000", engine, str(tmp_path), (41000, 41099)), sent.append,
                            Timings(start=0.01), counters, EngineSample(1, engine, tmp_path))
        shard = sup.start(spec())
        await settle(sup)
        await asyncio.wait_for(shard.concluded.wait(), 30)
        await sup.detach()
        return sent, counters
    sent, counters = asyncio.run(run())
    assert states(sent) == ["pending", "starting", "failed"] and counters.engines == 1
    assert sent[-1]["reason"] == "engine exited with status 3 during start"
    assert sent[-1]["process"]["pid"] < SYNTHETIC_PID and "CUDA out of memory" in sent[-1]["output_tail"]
    valid(sent)
