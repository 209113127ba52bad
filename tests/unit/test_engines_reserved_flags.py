"""Flags reserved for llmgw (KV events, KV transfer) and those the 0.33 / 0.5.23 pins made owned.

A hand-written value is refused at config load with the JSON pointer of the argv element, and by
the adapter before launch, in every form the engine's parser would read as that flag.
"""

import copy

import pytest

from llmgw.catalog import Model, Profile
from llmgw.config import ConfigInvalid
from llmgw.engines import LaunchContext, ProfileError, build_launch, get_adapter, validate_profile
from llmgw.settings import parse_server_settings

SERVER = {
    "api": {"listen": {"port": 8443}},
    "insecure_no_tls": True,
    "models": [{"name": "m", "source": "Qwen/Qwen2.5-0.5B-Instruct"}],
    "profiles": [{"name": "p", "engine": "vllm"}],
    "deployments": [{"model": "m", "profile": "p", "replicas": 1}],
}
EVENTS = '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557"}'
TRANSFER = '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'


def config_errors(engine: str, extra_args: list[str]) -> dict[str, str]:
    doc = copy.deepcopy(SERVER)
    doc["profiles"][0].update(engine=engine, extra_args=extra_args)
    with pytest.raises(ConfigInvalid) as e:
        parse_server_settings(doc)
    return {x.pointer: x.message for x in e.value.errors}


def refused(engine: str, *args: str) -> tuple[str, str]:
    """(problem, its pointer) of the one problem with ``args``."""
    with pytest.raises(ProfileError) as e:
        validate_profile(Profile("p", engine, extra_args=args))
    (problem,), (path,) = e.value.problems, e.value.paths
    return problem, path


# ----------------------------------------------------------------------------- vLLM

@pytest.mark.parametrize("args, flag", [
    (("--kv-events-config", EVENTS), "--kv-events-config"),
    ((f"--kv-events-config={EVENTS}",), "--kv-events-config"),
    (("--kv_events_config", EVENTS), "--kv-events-config"),
    (("--kv-events", EVENTS), "--kv-events-config"),  # argparse abbreviation
    (("--kv-events-config.publisher", "zmq"), "--kv-events-config"),  # FlexibleArgumentParser's dotted form
    (("--kv_events_config.endpoint=tcp://*:5557",), "--kv-events-config"),
    (("--kv-transfer-config", TRANSFER), "--kv-transfer-config"),
    (("--kv-transfer-config.kv_role", "kv_producer"), "--kv-transfer-config"),
    (("--kv-transfer-config.kv_connector_extra_config.backends+", "UCX"), "--kv-transfer-config"),
])
def test_vllm_kv_flags_are_reserved_in_every_form(args, flag):
    problem, path = refused("vllm", *args)
    assert flag in problem and "reserved for llmgw" in problem
    assert path == "extra_args/0"


@pytest.mark.parametrize("args, flag, reason", [
    (("--device-ids", "2,3"), "--device-ids", "CUDA_VISIBLE_DEVICES"),
    (("--grpc",), "--grpc", "OpenAI HTTP"),
    (("--grpc-port", "50051"), "--grpc-port", "OpenAI HTTP"),
    (("-dpm",), "--data-parallel-multi-port-external-lb", "replicas"),
    (("--data-parallel-multi-port-external-lb",), "--data-parallel-multi-port-external-lb", "replicas"),
])
def test_vllm_033_flags_that_fight_placement_or_routing_are_owned(args, flag, reason):
    problem, _ = refused("vllm", *args)
    assert flag in problem and reason in problem


def test_vllm_reserved_flags_point_at_their_argv_element_in_the_config():
    errs = config_errors("vllm", ["--enable-prefix-caching", "--kv-events-config", EVENTS,
                                  "--compilation-config.level", "3", "--kv-transfer-config.kv_role", "kv_both"])
    assert sorted(errs) == ["/profiles/0/extra_args/1", "/profiles/0/extra_args/5"]
    assert "--kv-events-config" in errs["/profiles/0/extra_args/1"]
    assert "--kv-transfer-config" in errs["/profiles/0/extra_args/5"]
    assert "reserved for llmgw" in errs["/profiles/0/extra_args/5"]


def test_vllm_other_dotted_and_kv_flags_stay_the_profiles():
    validate_profile(Profile("p", "vllm", extra_args=(
        "--compilation-config.level", "3", "--kv-cache-dtype", "fp8", "--kv-offloading-size", "4",
        "--enable-prefix-caching", "--block-size", "32")))


def test_vllm_device_memory_utilization_is_read_as_the_memory_share():
    adapter = get_adapter("vllm")
    fraction = adapter.memory_fraction(Profile("p", "vllm", extra_args=("--device-memory-utilization", "0.5")))
    assert fraction is not None and fraction.value == 0.5 and fraction.index == 0
    with pytest.raises(ProfileError) as e:
        validate_profile(Profile("p", "vllm", extra_args=("--max-num-seqs", "4", "--device_memory_utilization=2")))
    assert e.value.paths == ("extra_args/2",) and "outside (0, 1]" in e.value.problems[0]


@pytest.mark.parametrize("engine, model", [
    ("vllm", Model("m", "org/m", "m")),
    ("sglang", Model("m", "org/m", "m")),
])
def test_reserved_flags_are_not_emitted_yet(engine, model):
    spec = build_launch(model, Profile("p", engine),
                        LaunchContext(host="127.0.0.1", port=8000, model_path="org/m", gpu_indices=(0,)))
    assert not [t for t in spec.argv if t.startswith(("--kv-events", "--kv-transfer", "--disaggregation"))]


# --------------------------------------------------------------------------- SGLang

@pytest.mark.parametrize("args, flag", [
    (("--kv-events-config", EVENTS), "--kv-events-config"),
    ((f"--kv-events-config={EVENTS}",), "--kv-events-config"),
    (("--kv-events", EVENTS), "--kv-events-config"),
    (("--disaggregation-mode", "prefill"), "--disaggregation-mode"),
    (("--disaggregation-mode=decode",), "--disaggregation-mode"),
    (("--disaggregation-transfer-backend", "nixl"), "--disaggregation-transfer-backend"),
    (("--disaggregation-bootstrap-port", "8998"), "--disaggregation-bootstrap-port"),
    (("--disaggregation-ib-device", "mlx5_0"), "--disaggregation-ib-device"),
    (("--load-publish-endpoint", "auto"), "--load-publish-endpoint"),
])
def test_sglang_kv_events_and_disaggregation_flags_are_reserved(args, flag):
    problem, path = refused("sglang", *args)
    assert flag in problem and "reserved for llmgw" in problem
    assert path == "extra_args/0"


def test_sglang_reserved_flags_point_at_their_argv_element_in_the_config():
    errs = config_errors("sglang", ["--disaggregation-decode-polling-interval", "2", "--mem-fraction-static", "0.8",
                                    "--disaggregation-mode", "decode", "--kv-events-config", EVENTS])
    assert sorted(errs) == ["/profiles/0/extra_args/4", "/profiles/0/extra_args/6"]
    assert "--disaggregation-mode" in errs["/profiles/0/extra_args/4"]
    assert "--kv-events-config" in errs["/profiles/0/extra_args/6"]


@pytest.mark.parametrize("args, flag, reason", [
    (("--smg-grpc-mode",), "--smg-grpc-mode", "OpenAI HTTP"),
    (("--grpc-mode",), "--grpc-mode", "OpenAI HTTP"),
    (("--ssl-certfile", "/etc/c.pem"), "--ssl-certfile", "plain HTTP"),
    (("--ssl-keyfile", "/etc/k.pem"), "--ssl-keyfile", "plain HTTP"),
    (("--enable-ssl-refresh",), "--enable-ssl-refresh", "plain HTTP"),
])
def test_sglang_flags_that_would_leave_http_are_owned(args, flag, reason):
    problem, _ = refused("sglang", *args)
    assert flag in problem and reason in problem
