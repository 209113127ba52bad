import pytest

from llmgw.router.errors import RouterError
from llmgw.router.request import parse_body


def test_reads_model_and_stream_only():
    p = parse_body(b'{"model": "m", "stream": true, "messages": []}')
    assert (p.model, p.stream) == ("m", True)
    assert parse_body(b'{"model": "m", "stream": null}').stream is False
    assert parse_body(b'{"model": "m"}').stream is False


@pytest.mark.parametrize("body,param,code", [
    (b"", None, "invalid_json"),
    (b"{not json", None, "invalid_json"),
    (b"\xff\xfe", None, "invalid_json"),
    (b"[1, 2]", None, "invalid_json"),
    (b'{"messages": []}', "model", "missing_model"),
    (b'{"model": 3}', "model", "invalid_model"),
    (b'{"model": ""}', "model", "invalid_model"),
    (b'{"model": "m", "stream": "yes"}', "stream", "invalid_type"),
    # steering a KV transfer is the router's alone (prefill/decode disaggregation)
    (b'{"model": "m", "kv_transfer_params": {"do_remote_prefill": true}}', "kv_transfer_params",
     "unsupported_parameter"),
    (b'{"model": "m", "kv_transfer_params": null}', "kv_transfer_params", "unsupported_parameter"),
    (b'{"model": "m", "bootstrap_host": "10.0.0.9", "bootstrap_room": 1}', "bootstrap_host", "unsupported_parameter"),
    (b'{"model": "m", "bootstrap_port": 8998}', "bootstrap_port", "unsupported_parameter"),
    (b'{"model": "m", "bootstrap_room": 1}', "bootstrap_room", "unsupported_parameter"),
    (b'{"a":' * 100_000, None, "invalid_json"),  # nested past the decoder's recursion limit
    (b'[' * 100_000, None, "invalid_json"),
])
def test_bad_bodies_are_400_naming_the_field(body, param, code):
    with pytest.raises(RouterError) as ei:
        parse_body(body)
    e = ei.value
    assert e.status == 400 and e.param == param and e.code == code
    import json
    doc = json.loads(e.body())
    assert set(doc["error"]) == {"message", "type", "param", "code"}
    assert doc["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("body", [
    b'{"model":"m","stream":true,"messages":[{"role":"user","content":"h\\u00e9 \\ud83d\\ude00"}]}',
    '{"model":"m\u00e9","stream":false}'.encode("utf-8"),
    '{"model":"m"}'.encode("utf-8-sig"),
    '{"model":"m"}'.encode("utf-16"),
    '{"model":"m"}'.encode("utf-16-le"),
    b'{"model":"m","x":"\xed\xa0\x80"}',  # a lone surrogate, as json.loads(bytes) lets through
    b' {"model":"m"} ',
])
def test_bodies_decode_as_json_loads_decodes_them(body):
    import json
    assert parse_body(body).payload == json.loads(body)


@pytest.mark.parametrize("body", [b'{"model":"m"}x', b'{"model":"\xff"}', b'{"model":"m",}'])
def test_bodies_json_loads_refuses_are_400(body):
    with pytest.raises(RouterError) as e:
        parse_body(body)
    assert e.value.status == 400
