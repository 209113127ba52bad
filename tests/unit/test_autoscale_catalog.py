"""The ``autoscale`` block of a deployment: parsed with the schema's defaults, refused at its JSON pointer."""

from __future__ import annotations

import copy

import pytest

from autoscale_docs import SERVER, errors

from llmgw.catalog import Autoscale
from llmgw.settings import parse_server_settings


def test_defaults_are_the_schemas_and_a_plain_deployment_has_none():
    doc = copy.deepcopy(SERVER)
    doc["deployments"].append({"model": "m", "profile": "q", "replicas": 2})
    doc["profiles"].append({"name": "q", "engine": "vllm"})
    deps = parse_server_settings(doc).catalog.deployments
    assert deps[0].autoscale == Autoscale(max=4)
    assert deps[0].autoscale.min == 1 and deps[0].autoscale.stable_window == 60
    assert deps[1].autoscale is None


@pytest.mark.parametrize("block, pointer, words", [
    ({"max": 2, "min": 3}, "/deployments/0/autoscale/min", "more than max"),
    ({"max": 2, "panic_window": 90}, "/deployments/0/autoscale/panic_window", "longer than stable_window"),
    ({"max": 2, "target": 0}, "/deployments/0/autoscale/target", ""),
    ({"max": 2, "signal": "kv_cache"}, "/deployments/0/autoscale/signal", ""),
    ({"max": 2, "stable_windw": 9}, "/deployments/0/autoscale/stable_windw", "unknown key"),
    ({"min": 1}, "/deployments/0/autoscale", "max"),
    ({"max": 2, "signal": "queue_depth", "headroom": 3}, "/deployments/0/autoscale/headroom", "not a count"),
    ({"max": 2, "headroom": -1}, "/deployments/0/autoscale/headroom", ""),
    ({"max": 2, "max_scale_up_rate": 1}, "/deployments/0/autoscale/max_scale_up_rate", "more than 1, or 0"),
    ({"max": 2, "min": 0, "signal": "queue_depth"}, "/deployments/0/autoscale/min", "needs signal: outstanding"),
    ({"max": 2, "min": 0, "sleep": {"after": 60}}, "/deployments/0/autoscale/min", "choose one"),
])
def test_bad_blocks_are_refused_at_their_key(block, pointer, words):
    doc = copy.deepcopy(SERVER)
    doc["deployments"][0]["autoscale"] = block
    errs = errors(doc)
    assert pointer in errs and words in errs[pointer], errs


def test_autoscale_without_the_in_process_router_is_accepted():
    # standalone routers report their load (POST /v1/router/load): the signal needs no router in process
    doc = copy.deepcopy(SERVER)
    del doc["router"]
    parse_server_settings(doc)


def test_min_zero_on_the_routers_signal_is_accepted():
    """Scale from zero: the routers hold a request for a model at zero and its wake starts a replica."""
    doc = copy.deepcopy(SERVER)
    doc["deployments"][0]["autoscale"] = {"min": 0, "max": 2}
    assert parse_server_settings(doc).catalog.deployments[0].autoscale.min == 0
