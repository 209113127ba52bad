"""LLMGW_SIM_* knobs: defaults, parsing, and errors that name the variable."""

import pytest

from llmgw.sim.sim_knobs import Fault, KnobError, Knobs, knobs_from_env, parse_fault


def test_defaults():
    assert knobs_from_env({}) == Knobs()
    assert Knobs().output_tokens == 16 and Knobs().embed_dim == 16
    assert Knobs().prefix_cache_blocks == 4096


def test_values_are_read():
    k = knobs_from_env({"LLMGW_SIM_STARTUP_DELAY": "2.5", "LLMGW_SIM_TOKEN_LATENCY": "0.02",
                        "LLMGW_SIM_OUTPUT_TOKENS": "7", "LLMGW_SIM_EMBED_DIM": "64",
                        "LLMGW_SIM_PREFIX_CACHE_BLOCKS": "10", "LLMGW_SIM_FAULT": "crash-after:3"})
    assert (k.startup_delay, k.token_latency, k.output_tokens, k.embed_dim) == (2.5, 0.02, 7, 64)
    assert k.prefix_cache_blocks == 10
    assert k.fault == Fault("crash-after", 3)


def test_the_timing_model_knobs_are_read_and_off_by_default():
    assert (Knobs().prefill_token_latency, Knobs().decode_batch_slowdown) == (0.0, 0.0)
    k = knobs_from_env({"LLMGW_SIM_PREFILL_TOKEN_LATENCY": "0.0002", "LLMGW_SIM_DECODE_BATCH_SLOWDOWN": "0.05"})
    assert (k.prefill_token_latency, k.decode_batch_slowdown) == (0.0002, 0.05)


@pytest.mark.parametrize("name,value", [
    ("LLMGW_SIM_PREFIX_CACHE_BLOCKS", "1"),  # one block is the null block: nothing could run
    ("LLMGW_SIM_PREFILL_TOKEN_LATENCY", "-1"),
    ("LLMGW_SIM_DECODE_BATCH_SLOWDOWN", "nan"),
])
def test_kv_and_timing_knobs_out_of_range_name_the_variable(name, value):
    with pytest.raises(KnobError, match=name):
        knobs_from_env({name: value})


@pytest.mark.parametrize("value,fault", [
    ("", Fault()), ("hang", Fault("hang")), ("http-500", Fault("http-500")),
    ("exit-during-start", Fault("exit-during-start")), ("error-chunk-after:0", Fault("error-chunk-after", 0)),
])
def test_faults(value, fault):
    assert parse_fault(value) == fault


@pytest.mark.parametrize("value,needle", [
    ("explode", "unknown fault 'explode'"),
    ("crash-after", "needs a token count"),
    ("crash-after:x", "needs a token count"),
    ("hang:3", "takes no argument"),
])
def test_bad_faults_name_the_variable(value, needle):
    with pytest.raises(KnobError) as e:
        parse_fault(value)
    assert "LLMGW_SIM_FAULT" in str(e.value) and needle in str(e.value)


@pytest.mark.parametrize("env,needle", [
    ({"LLMGW_SIM_TOKEN_LATENCY": "fast"}, "LLMGW_SIM_TOKEN_LATENCY='fast': must be a number"),
    ({"LLMGW_SIM_OUTPUT_TOKENS": "0"}, "LLMGW_SIM_OUTPUT_TOKENS='0': must be >= 1"),
    ({"LLMGW_SIM_EMBED_DIM": "1.5"}, "must be an integer"),
    ({"LLMGW_SIM_STARTUP_DELAY": "nan"}, "must be >= 0"),
])
def test_bad_numbers_name_the_variable(env, needle):
    with pytest.raises(KnobError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        knobs_from_env(env)


@pytest.mark.parametrize("fault,onset,want", [
    ("wedge", "", Fault("wedge")),
    ("wedge", "signal", Fault("wedge", 0, "signal")),
    ("engine-dead", "after:2.5", Fault("engine-dead", 0, "after", 2.5)),
    ("hang", "start", Fault("hang")),
])
def test_fault_onset(fault, onset, want):
    assert knobs_from_env({"LLMGW_SIM_FAULT": fault, "LLMGW_SIM_FAULT_ONSET": onset}).fault == want


@pytest.mark.parametrize("env,needle", [
    ({"LLMGW_SIM_FAULT": "hang", "LLMGW_SIM_FAULT_ONSET": "later"}, "known: start, after:N, signal"),
    ({"LLMGW_SIM_FAULT": "hang", "LLMGW_SIM_FAULT_ONSET": "after:-1"}, "after needs seconds >= 0"),
    ({"LLMGW_SIM_FAULT_ONSET": "signal"}, "no LLMGW_SIM_FAULT to begin"),
    ({"LLMGW_SIM_FAULT": "exit-during-start", "LLMGW_SIM_FAULT_ONSET": "signal"}, "only begin at start"),
])
def test_bad_onset_names_the_variable(env, needle):
    with pytest.raises(KnobError) as e:
        knobs_from_env(env)
    assert "LLMGW_SIM_FAULT_ONSET" in str(e.value) and needle in str(e.value)
