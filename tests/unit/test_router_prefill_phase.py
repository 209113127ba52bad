"""The prefill phase's pure parts: the two requests it builds, the answers it accepts, the groups by role."""

from __future__ import annotations

import json

import pytest

from llmgw.kvtransfer import PREFILL_REQUEST
from llmgw.router.endpoints import Endpoint, EndpointError, EndpointTable
from llmgw.router.metrics import RouterMetrics
from llmgw.router.prefill import _params, decode_body, prefill_body
from llmgw.router.runtime import Routing
from llmgw.router.balancing import LeastOutstanding
from llmgw.router.settings import RouterSettings

GOOD = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2],
        "remote_engine_id": "e", "remote_request_id": "r", "remote_host": "10.0.0.5", "remote_port": 5600,
        "tp_size": 1, "transfer_mode": "pull"}


def test_the_prefill_request_is_one_token_not_streamed_and_asks_for_held_blocks():
    body = json.loads(prefill_body({"model": "m", "prompt": "p", "stream": True, "max_tokens": 50,
                                    "stream_options": {"include_usage": True}, "max_completion_tokens": 50}))
    assert body == {"model": "m", "prompt": "p", "stream": False, "max_tokens": 1, "max_completion_tokens": 1,
                    "kv_transfer_params": PREFILL_REQUEST}


def test_the_decode_request_is_the_clients_with_the_answer_verbatim():
    payload = {"model": "m", "prompt": "p", "stream": True, "max_tokens": 50}
    assert json.loads(decode_body(payload, GOOD)) == {**payload, "kv_transfer_params": GOOD}


@pytest.mark.parametrize("status, data, why", [
    (200, json.dumps({"kv_transfer_params": GOOD}).encode(), ""),
    (200, b"[1]", "not a JSON object"),
    (200, json.dumps({"kv_transfer_params": None}).encode(), "expected an object"),
    (200, json.dumps({"kv_transfer_params": {**GOOD, "remote_port": 0}}).encode(), "remote_port"),
    (200, json.dumps({"kv_transfer_params": {k: v for k, v in GOOD.items() if k != "remote_engine_id"}}).encode(),
     "remote_engine_id: missing"),
])
def test_only_an_answer_a_decoder_can_use_is_taken(status, data, why):
    params, got = _params(status, data)
    assert (params is not None) == (why == "")
    assert why in got


def test_roles_are_validated_and_prefill_endpoints_form_their_own_group():
    with pytest.raises(EndpointError, match="role: must be one of"):
        Endpoint.from_dict({"model": "m", "url": "http://a:1", "role": "encode"}, where="/static_endpoints/0")
    eps = [Endpoint.from_dict({"id": "p", "model": "m", "url": "http://a:1", "role": "prefill"}),
           Endpoint.from_dict({"id": "d", "model": "m", "url": "http://b:1", "role": "decode"}),
           Endpoint.from_dict({"id": "x", "model": "plain", "url": "http://c:1"})]
    assert Endpoint.from_dict(eps[0].to_dict()).role == "prefill"
    assert "role" not in eps[2].to_dict()  # routers that predate roles refuse the key
    routing = Routing(EndpointTable(eps), RouterSettings(), RouterMetrics(), LeastOutstanding())
    g = routing.group("m")
    assert [m.id for m in g.members] == ["d"] and [m.id for m in g.prefill.members] == ["p"]
    assert routing.group("plain").prefill is None
    assert routing.pick_prefill(g.prefill, set()).id == "p"
    assert routing.pick_prefill(g.prefill, {"p"}) is None
