"""The simulator's timing presets (LLMGW_SIM_TIMING) and the least-squares fit that produces them."""

import pytest

from llmgw.sim import sim_timing
from llmgw.sim.sim_knobs import KnobError, knobs_from_env
from llmgw.sim.sim_timing import PRESETS, Fit, expand, fit, inter_token, least_squares, ttft


def test_a_preset_fills_the_timing_knobs():
    preset = PRESETS["vllm-cpu-tiny"].knobs
    k = knobs_from_env({"LLMGW_SIM_TIMING": "vllm-cpu-tiny"})
    assert k.prefill_token_latency == float(preset["LLMGW_SIM_PREFILL_TOKEN_LATENCY"]) > 0
    assert k.token_latency == float(preset["LLMGW_SIM_TOKEN_LATENCY"]) > 0
    assert k.decode_batch_slowdown == float(preset["LLMGW_SIM_DECODE_BATCH_SLOWDOWN"])


def test_an_explicit_knob_wins_over_the_preset_and_an_empty_one_does_not():
    k = knobs_from_env({"LLMGW_SIM_TIMING": "vllm-cpu-tiny", "LLMGW_SIM_TOKEN_LATENCY": "0.5",
                        "LLMGW_SIM_PREFILL_TOKEN_LATENCY": ""})
    assert k.token_latency == 0.5
    assert k.prefill_token_latency == float(PRESETS["vllm-cpu-tiny"].knobs["LLMGW_SIM_PREFILL_TOKEN_LATENCY"])


def test_no_preset_leaves_the_environment_as_it_is():
    env = {"LLMGW_SIM_TOKEN_LATENCY": "0.1"}
    assert expand(env) == env and expand({**env, "LLMGW_SIM_TIMING": "none"})["LLMGW_SIM_TOKEN_LATENCY"] == "0.1"
    assert knobs_from_env({"LLMGW_SIM_TIMING": ""}).token_latency == 0.0


def test_an_unknown_preset_names_the_variable_and_the_known_ones():
    with pytest.raises(KnobError, match=r"LLMGW_SIM_TIMING='h100'.*vllm-cpu-tiny"):
        knobs_from_env({"LLMGW_SIM_TIMING": "h100"})


def test_every_preset_is_valid_and_says_where_it_came_from():
    for name, preset in PRESETS.items():
        assert set(preset.knobs) == set(Fit(0, 0, 1, 0).knobs()), name
        knobs_from_env(dict(preset.knobs))  # parses: a preset cannot hold a value the knobs refuse
        assert preset.source


def test_least_squares_recovers_a_line_and_refuses_a_single_x():
    b, m = least_squares([0, 1, 2, 3], [1.0, 3.0, 5.0, 7.0])
    assert (b, m) == pytest.approx((1.0, 2.0))
    with pytest.raises(ValueError):
        least_squares([2, 2], [1.0, 2.0])


def test_the_fit_inverts_the_model():
    p, t, s = 2e-4, 0.01, 0.15
    prefill = [(n, ttft(p, t, n)) for n in (32, 256, 1024) for _ in range(3)]
    decode = [(b, inter_token(t, s, b)) for b in (1, 2, 4, 8) for _ in range(3)]
    f = fit(prefill, decode)
    assert (f.prefill_token_latency, f.prefill_intercept, f.token_latency, f.decode_batch_slowdown) == \
        pytest.approx((p, t, t, s))
    assert f.knobs() == {"LLMGW_SIM_PREFILL_TOKEN_LATENCY": "0.0002", "LLMGW_SIM_TOKEN_LATENCY": "0.01",
                         "LLMGW_SIM_DECODE_BATCH_SLOWDOWN": "0.15"}


def test_noise_on_a_flat_curve_clamps_to_zero_not_a_negative_knob():
    f = fit([(32, 0.02), (1024, 0.019)], [(1, 0.01), (8, 0.0099)])
    assert f.prefill_token_latency == 0.0 and f.decode_batch_slowdown == 0.0
    with pytest.raises(ValueError, match="intercept"):
        fit([(32, 0.02), (1024, 0.03)], [(1, 0.0), (8, 0.01)])


def test_the_model_is_what_the_simulator_applies():
    from llmgw.sim.sim_args import parse_argv
    from llmgw.sim.sim_http import SimState

    state = SimState(parse_argv(["serve", "m", "--port", "8000"]),
                     knobs_from_env({"LLMGW_SIM_TOKEN_LATENCY": "0.01", "LLMGW_SIM_DECODE_BATCH_SLOWDOWN": "0.2"}))
    state.running = 4
    assert state.token_latency() == pytest.approx(sim_timing.inter_token(0.01, 0.2, 4))
