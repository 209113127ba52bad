"""Scale to sleep in the catalog: the ``autoscale.sleep`` block, where it is refused, and the launch it asks for.

A deployment with ``sleep`` gets shards whose spec says ``sleep_mode``; the
vLLM adapter then launches with ``--enable-sleep-mode`` and, on rank 0 only,
``VLLM_SERVER_DEV_MODE=1`` (which attaches ``/sleep`` and ``/wake_up``).  A
profile may not turn either on by itself: dev mode opens routes outside the
engine key's check, so only the deployment's block, which the control plane
drives, decides it.
"""

from __future__ import annotations

import copy

import pytest

from llmgw.catalog import Autoscale, Model, Profile, Sleep
from llmgw.config import ConfigInvalid
from llmgw.engines import LaunchContext, ProfileError, build_launch, validate_profile
from llmgw.settings import parse_server_settings

SERVER = {
    "api": {"listen": {"port": 8443}},
    "insecure_no_tls": True,
    "router": {"listen": {"port": 8080}, "insecure_http": True, "allow_unauthenticated": True},
    "models": [{"name": "m", "source": "Qwen/Qwen2.5-0.5B-Instruct"}],
    "profiles": [{"name": "p", "engine": "vllm"}, {"name": "cpp", "engine": "llamacpp"}],
    "deployments": [{"model": "m", "profile": "p", "replicas": 1,
                     "autoscale": {"max": 2, "sleep": {"after": 30}}}],
}
HUB = Model(name="m", source="org/m", served_name="m")


def errors(doc) -> dict[str, str]:
    with pytest.raises(ConfigInvalid) as e:
        parse_server_settings(doc)
    return {x.pointer: x.message for x in e.value.errors}


def test_the_block_parses_with_level_1_by_default():
    (dep,) = parse_server_settings(copy.deepcopy(SERVER)).catalog.deployments
    assert dep.autoscale == Autoscale(max=2, sleep=Sleep(after=30.0, level=1))
    doc = copy.deepcopy(SERVER)
    doc["deployments"][0]["autoscale"]["sleep"]["level"] = 2
    assert parse_server_settings(doc).catalog.deployments[0].autoscale.sleep == Sleep(30.0, 2)


def test_sleep_on_an_engine_without_a_sleep_mode_is_refused_at_the_block():
    doc = copy.deepcopy(SERVER)
    doc["deployments"][0]["profile"] = "cpp"
    errs = errors(doc)
    assert "no sleep mode" in errs["/deployments/0/autoscale/sleep"] and "vllm" in errs[
        "/deployments/0/autoscale/sleep"], errs


@pytest.mark.parametrize("block, pointer", [
    ({"after": 30, "level": 3}, "/deployments/0/autoscale/sleep/level"),
    ({"after": 0}, "/deployments/0/autoscale/sleep/after"),
    ({"level": 1}, "/deployments/0/autoscale/sleep"),
    ({"after": 30, "lvl": 1}, "/deployments/0/autoscale/sleep/lvl"),
])
def test_bad_sleep_blocks_are_refused_at_their_key(block, pointer):
    doc = copy.deepcopy(SERVER)
    doc["deployments"][0]["autoscale"]["sleep"] = block
    assert pointer in errors(doc)


def ctx(**kw):
    base = dict(host="10.0.0.5", port=8001, model_path=HUB.source, gpu_indices=(0,))
    base.update(kw)
    return LaunchContext(**base)


def test_sleep_mode_launches_vllm_with_the_flag_and_dev_mode_on_rank_0_only():
    plain = build_launch(HUB, Profile("p", "vllm"), ctx())
    assert "--enable-sleep-mode" not in plain.argv and "VLLM_SERVER_DEV_MODE" not in plain.env
    spec = build_launch(HUB, Profile("p", "vllm"), ctx(sleep_mode=True))
    assert spec.argv[-1] == "--enable-sleep-mode" and spec.env["VLLM_SERVER_DEV_MODE"] == "1"
    worker = build_launch(HUB, Profile("p", "vllm", nodes=2, tensor_parallel_size=2),
                          ctx(sleep_mode=True, rank=1, nnodes=2, master_addr="10.0.0.4", master_port=29500,
                              gpu_indices=(0,)))
    assert "--enable-sleep-mode" in worker.argv and "VLLM_SERVER_DEV_MODE" not in worker.env


@pytest.mark.parametrize("profile, pointer", [
    (Profile("p", "vllm", extra_args=("--enable-sleep-mode",)), "extra_args/0"),
    (Profile("p", "vllm", env=(("VLLM_SERVER_DEV_MODE", "1"),)), "env/VLLM_SERVER_DEV_MODE"),
])
def test_a_profile_cannot_open_dev_mode_by_itself(profile, pointer):
    with pytest.raises(ProfileError) as e:
        validate_profile(profile)
    assert pointer in e.value.paths and "autoscale" in str(e.value), (e.value.paths, str(e.value))
