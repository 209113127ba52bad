"""How the integration suite shares out among xdist workers (``make test`` runs it on
INTEGRATION_WORKERS processes with ``--dist loadgroup``).

Most of these tests wait on real processes (a control plane noticing a silent node, an
engine getting ready) and use little CPU, so several run side by side. Each file stays on
one worker, as ``--dist loadfile`` would keep it: its module fixtures (a 200-node fleet,
an etcd cluster) are built once. The files that load the CPU for long (simulated fleets of
hundreds of nodes, fuzzing, the real llama-server and vLLM, the chaos run) share one group, so they
run one after another on one worker and never starve each other into a timeout.

They also run at a lower CPU priority (``HEAVY_NICE``, inherited by every process they start:
engines, simulated fleets, control planes): a real vLLM starting (two processes importing
torch, four for a prefill/decode pair) took both cores for a minute, and a control plane in a
test beside it went 20 s between an agent's connect and its registration, long enough for the
short heartbeats and health checks the light tests use to call a healthy engine dead. Most
light tests sleep on timers; given the CPU first when they wake, they leave the heavy files
nearly all of it. Engines run in sessions of their own, which the kernel's autogroups weigh
apart from their niceness; ``SessionNicer`` lowers those groups too (``tests/support/cpushare``).
"""

from __future__ import annotations

import os

import pytest

from tests.support.cpushare import SessionNicer

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


HEAVY_NICE = 10  # CFS weight 110 against 1024 at 0: a waking light test gets about 90 % of a contended core


@pytest.fixture(scope="module", autouse=True)
def heavy_files_yield_the_cpu(request: pytest.FixtureRequest):
    """A CPU_HEAVY module (and all it starts, module fixtures included: autouse fixtures are set up
    before the others of their scope) runs at HEAVY_NICE; the worker goes back to its niceness after.
    Going back needs root (CI); elsewhere the worker stays niced, which costs nothing but priority."""
    if request.path.name not in CPU_HEAVY:
        yield
        return
    before = os.getpriority(os.PRIO_PROCESS, 0)
    os.setpriority(os.PRIO_PROCESS, 0, max(before, HEAVY_NICE))
    try:
        with SessionNicer(os.getpid(), HEAVY_NICE):  # engines run in sessions of their own
            yield
    finally:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, before)
        except PermissionError:
            pass


@pytest.fixture(scope="session")
def shared_vllm(tmp_path_factory: pytest.TempPathFactory):
    """One real vLLM for the modules that only send it requests (``realvllm.shared_engine``).
    Defined here, once: a fixture imported into a test module is that module's own, and each
    definition of a session fixture starts its own engine (two did)."""
    import realvllm  # here, not at the top: this file is also run on its own (test_integration_groups)

    with realvllm.shared_engine(tmp_path_factory.mktemp("shared-vllm")) as shared:
        yield shared
