"""vLLM short aliases and world-size flags the adapter owns (vllm/engine/arg_utils.py)."""

import pytest

from llmgw.catalog import Profile
from llmgw.engines import ProfileError, validate_profile
from llmgw.engines.vllm import _OWNED

# Every short alias vLLM's parallel group gives a flag the adapter owns.
SHORT_ALIASES = {
    "-tp": "--tensor-parallel-size", "-pp": "--pipeline-parallel-size",
    "-pcp": "--prefill-context-parallel-size", "-n": "--nnodes", "-r": "--node-rank",
    "-dp": "--data-parallel-size", "-dpn": "--data-parallel-rank", "-dpr": "--data-parallel-start-rank",
    "-dpl": "--data-parallel-size-local", "-dpa": "--data-parallel-address",
    "-dpp": "--data-parallel-rpc-port", "-dpb": "--data-parallel-backend",
    "-dph": "--data-parallel-hybrid-lb", "-dpe": "--data-parallel-external-lb",
}


def refused(*args: str) -> str:
    with pytest.raises(ProfileError) as e:
        validate_profile(Profile("p", "vllm", extra_args=args))
    (problem,) = e.value.problems
    return problem


def test_every_short_alias_is_owned_with_its_long_form():
    owned = {f.name: set(f.spellings) for f in _OWNED}
    for short, long in SHORT_ALIASES.items():
        assert short in owned.get(long, ()), f"{short} ({long}) not owned"


@pytest.mark.parametrize("args", [
    ("--prefill-context-parallel-size", "2"), ("--prefill-context-parallel-size=2",),
    ("-pcp", "2"), ("-pcp=2",), ("--prefill_context_parallel_size", "2"), ("--prefill-context", "2"),
])
def test_prefill_context_parallel_is_refused_in_every_spelling(args):
    problem = refused(*args)
    assert "--prefill-context-parallel-size" in problem and "placement reserves" in problem


@pytest.mark.parametrize("args,long", [
    (("-dpe",), "--data-parallel-external-lb"), (("-dpe=true",), "--data-parallel-external-lb"),
    (("-dph",), "--data-parallel-hybrid-lb"), (("-dph=1",), "--data-parallel-hybrid-lb"),
])
def test_load_balancer_switches_are_refused_by_short_name(args, long):
    problem = refused(*args)
    assert long in problem and repr(args[0]) in problem and "replicas" in problem


def test_decode_context_parallel_reuses_tp_ranks_and_stays_allowed():
    validate_profile(Profile("p", "vllm", tensor_parallel_size=4,
                             extra_args=("-dcp", "2", "--decode-context-parallel-size=2")))
