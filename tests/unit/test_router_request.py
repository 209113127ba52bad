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
