"""How the integration suite shares out among xdist workers (``make test`` runs it on
INTEGRATION_WORKERS processes with ``--dist loadgroup``).

Most of these tests wait on real processes (a control plane noticing a silent node, an
engine getting ready) and use little CPU, so several run side by side. Each file stays on
one worker, as ``--dist loadfile`` would keep it: its module fixtures (a 200-node fleet,
an etcd cluster) are built once. The files that load the CPU for long (simulated fleets of
hundreds of nodes, fuzzing, the real llama-server and vLLM, the chaos run) share one group, so they
run one after another on one worker and never starve each other into a timeout.
"""

from __future__ import annotations

import pytest

CPU_HEAVY = frozenset({
    "test_admin_api_fuzz.py",
    "test_chaos.py",
    "test_client_bounds.py",
    "test_fleet_bench_quick.py",
    "test_fleet_etcd_members.py",
    "test_fleet_failover.py",
    "test_fleet_grants.py",
    "test_fleet_sim.py",
    "test_fleet_stall.py",
    "test_llamacpp_e2e.py",
    "test_router_openai.py",
    "test_sim_vs_vllm.py",
    "test_vllm_e2e.py",
    "test_vllm_kv_events.py",
    "test_vllm_pd.py",
})


# tryfirst: pytest-xdist's own hook turns the marks into the ids it schedules by; a mark added
# after it has run groups nothing.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        name = item.path.name
        item.add_marker(pytest.mark.xdist_group("cpu-heavy" if name in CPU_HEAVY else name))
