"""The simulator's ``--kv-transfer-config``: refused as vLLM's KVTransferConfig refuses it, naming the field."""

from __future__ import annotations

import argparse
import json

import pytest

from llmgw.sim.sim_args import kv_transfer_json


def parse(**doc):
    return kv_transfer_json(json.dumps(doc))


def test_roles_and_the_default_policy():
    c = parse(kv_connector="NixlConnector", kv_role="kv_both", kv_buffer_device="cpu")
    assert (c.producer, c.consumer, c.load_failure_policy, c.engine_id) == (True, True, "fail", None)  # vLLM 0.32's
    c = parse(kv_connector="NixlConnector", kv_role="kv_consumer", kv_load_failure_policy="recompute", engine_id="e1")
    assert (c.producer, c.consumer, c.load_failure_policy, c.engine_id) == (False, True, "recompute", "e1")


@pytest.mark.parametrize("doc, says", [
    ({"kv_connector": "NixlConnector", "kv_role": "kv_everything"}, "KVTransferConfig.kv_role: 'kv_everything'"),
    ({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_load_failure_policy": "retry"},
     "kv_load_failure_policy: 'retry'"),
    ({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_colour": 1}, "unexpected field 'kv_colour'"),
    ({"kv_connector": "P2pNcclConnector", "kv_role": "kv_both"}, "models only NixlConnector"),
    ({"kv_connector": "NixlConnector", "kv_role": "kv_both", "engine_id": ""}, "engine_id: expected a non-empty"),
])
def test_bad_configs_name_the_field(doc, says):
    with pytest.raises(argparse.ArgumentTypeError, match=None) as e:
        kv_transfer_json(json.dumps(doc))
    assert says in str(e.value)


def test_not_an_object():
    with pytest.raises(argparse.ArgumentTypeError, match="expected a JSON object"):
        kv_transfer_json("[1]")
