"""SGLang's pairs, the pure parts: what names the pair in both requests, and which models are served so."""

from __future__ import annotations

import json

import pytest

from llmgw.router.balancing import LeastOutstanding
from llmgw.kvbootstrap import ROOM_BITS, bootstrap_fields
from llmgw.router.dualdispatch import paired_bodies
from llmgw.router.endpoints import Endpoint, EndpointError, EndpointTable
from llmgw.router.metrics import RouterMetrics
from llmgw.router.runtime import Routing
from llmgw.router.settings import RouterSettings


def test_both_requests_name_the_prefills_bootstrap_and_one_room():
    fields = bootstrap_fields("http://10.0.0.5:8001", 20417, 2**62 + 7)
    assert fields == {"bootstrap_host": "10.0.0.5", "bootstrap_port": 20417, "bootstrap_room": 2**62 + 7}
    assert bootstrap_fields("https://[fd00::5]:8001", 9, 1)["bootstrap_host"] == "fd00::5"
    payload = {"model": "m", "prompt": "p", "stream": True, "max_tokens": 50, "stream_options": {"include_usage": True}}
    prefill, decode = (json.loads(b) for b in paired_bodies(payload, fields))
    assert decode == {**payload, **fields}  # the client's request as it came, naming the pair
    assert prefill == {"model": "m", "prompt": "p", "stream": False, "max_tokens": 50, **fields}
    assert ROOM_BITS == 63  # SGLang's rooms are non-negative 64-bit integers


def test_bootstrap_and_requires_prefill_only_where_they_mean_something():
    ok = Endpoint.from_dict({"id": "p", "model": "m", "url": "http://a:1", "role": "prefill", "bootstrap_port": 9})
    assert Endpoint.from_dict(ok.to_dict()).bootstrap_port == 9
    with pytest.raises(EndpointError, match="bootstrap_port"):
        Endpoint.from_dict({"model": "m", "url": "http://a:1", "role": "decode", "bootstrap_port": 9})
    with pytest.raises(EndpointError, match="bootstrap_port"):
        Endpoint.from_dict({"model": "m", "url": "http://a:1", "role": "prefill", "bootstrap_port": 70000})
    with pytest.raises(EndpointError, match="/bootstrap_port: must be an integer"):
        Endpoint.from_dict({"model": "m", "url": "http://a:1", "role": "prefill", "bootstrap_port": "9"}, where="/e")
    with pytest.raises(EndpointError, match="requires_prefill"):
        Endpoint.from_dict({"model": "m", "url": "http://a:1", "role": "prefill", "requires_prefill": True})
    with pytest.raises(EndpointError, match="/requires_prefill: must be a boolean"):
        Endpoint.from_dict({"model": "m", "url": "http://a:1", "role": "decode", "requires_prefill": 1}, where="/e")
    plain = Endpoint.from_dict({"model": "m", "url": "http://a:1"}).to_dict()
    assert "bootstrap_port" not in plain and "requires_prefill" not in plain  # older routers refuse the keys


def groups(*eps: dict) -> Routing:
    return Routing(EndpointTable([Endpoint.from_dict(e) for e in eps]), RouterSettings(), RouterMetrics(),
                   LeastOutstanding())


def test_a_model_is_served_in_pairs_when_its_endpoints_speak_sglangs_protocol():
    r = groups({"id": "p", "model": "sg", "url": "http://a:1", "role": "prefill", "bootstrap_port": 9},
               {"id": "d", "model": "sg", "url": "http://b:1", "role": "decode", "requires_prefill": True},
               {"id": "p2", "model": "vl", "url": "http://a:2", "role": "prefill"},
               {"id": "d2", "model": "vl", "url": "http://b:2", "role": "decode"},
               {"id": "d3", "model": "orphan", "url": "http://b:3", "role": "decode", "requires_prefill": True},
               {"id": "x", "model": "plain", "url": "http://c:1"})
    assert r.group("sg").dual and not r.group("vl").dual and not r.group("plain").dual
    # decoders that need a prefill make a model dual even before any prefill endpoint is there
    orphan = r.group("orphan")
    assert orphan.dual and orphan.prefill is None
