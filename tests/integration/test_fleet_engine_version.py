"""The engine release on the replica: the agent reads it from rank 0 once after Ready.

Real control plane, agent and engine simulator, which answers vLLM's ``GET /version``
(``{"version": ...}``). The version travels in ``shard_status`` and shows on
``GET /v1/replicas``, for the replica and its rank-0 shard, and in ``llmgw ctl replicas``.
A restarted control plane, which rebuilds its replicas from the agents' register (which
carries no version), gets it again when its ``accepts`` names the field.
"""

from __future__ import annotations

import pytest

from fleet import Fleet
from llmgw.sim.sim_http import SIM_VERSION

pytestmark = pytest.mark.integration


def test_replica_shows_the_version_its_engine_reports(tmp_path):
    with Fleet(tmp_path, nodes={"a": 1}, replicas=1) as f:
        f.start()
        (replica,) = f.wait_ready(1)
        (shard,) = replica["shards"]
        assert (replica["engine_version"], shard["engine_version"]) == (SIM_VERSION, SIM_VERSION), f.dump()
        assert f"engine {SIM_VERSION}" in f.ctl("replicas").stdout



def test_a_restarted_control_plane_learns_the_version_again(tmp_path):
    with Fleet(tmp_path, nodes={"a": 1}, replicas=1) as f:
        f.start()
        (before,) = f.wait_ready(1, extra=lambda ready: ready[0]["engine_version"] == SIM_VERSION)
        f.server.kill()
        f.server.start()
        f.wait_healthy()
        (after,) = f.wait_ready(1, extra=lambda ready: ready[0]["engine_version"] is not None)
        # the same engine, never restarted: the version came with accepts, not with a new Ready
        assert after["shards"][0]["pid"] == before["shards"][0]["pid"]
        assert after["engine_version"] == after["shards"][0]["engine_version"] == SIM_VERSION
