import json

from llmgw.router.sse import (EventBuffer, Kind, classify, ends_with_done, error_message, first_error, iter_events,
                              last_boundary)

ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}'
TOK = b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}'
TEXT = b'data: {"choices":[{"index":0,"text":"hi","finish_reason":null}]}'
EMPTY_TEXT = b'data: {"choices":[{"index":0,"text":"","finish_reason":null}]}'
FINISH = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":1}}'
ERR = b'data: {"error":{"message":"EngineCore died","type":"InternalServerError","param":null,"code":500}}'
OLD_ERR = b'data: {"object":"error","message":"boom","type":"x","code":500}'


def test_buffer_releases_only_complete_events():
    b = EventBuffer()
    assert b.feed(TOK[:10]) == b""
    assert b.feed(TOK[10:] + b"\n\n" + ROLE[:5]) == TOK + b"\n\n"
    assert b.pending == ROLE[:5]
    assert b.feed(ROLE[5:] + b"\n") == b""
    assert b.feed(b"\n") == ROLE + b"\n\n"
    assert b.pending == b""


def test_crlf_boundaries():
    assert last_boundary(b"data: a\r\n\r\ndata: b") == len(b"data: a\r\n\r\n")
    assert last_boundary(b"data: a") == 0


def test_classify():
    assert classify(ROLE) is Kind.HOLD
    assert classify(b": keep-alive comment") is Kind.HOLD
    assert classify(EMPTY_TEXT) is Kind.HOLD
    for tok in (TOK, TEXT, FINISH, USAGE, b"data: not json", b"data: [1]"):
        assert classify(tok) is Kind.TOKEN, tok
    assert classify(b"data: [DONE]") is Kind.DONE
    assert classify(ERR) is Kind.ERROR
    assert classify(OLD_ERR) is Kind.ERROR


def test_error_detection_ignores_the_word_inside_token_text():
    quoted = json.dumps({"choices": [{"delta": {"content": 'the "error" key'}}]}).encode()
    data = b"data: " + quoted + b"\n\ndata: " + b'{"choices":[{"delta":{"content":"error"}}]}' + b"\n\n"
    assert first_error(data) is None
    data += ERR + b"\n\n"
    assert error_message(first_error(data)) == "EngineCore died"


def test_ends_with_done():
    assert ends_with_done(TOK + b"\n\ndata: [DONE]\n\n")
    assert ends_with_done(b"data:[DONE]\r\n\r\n")
    assert not ends_with_done(TOK + b"\n\n")
    assert not ends_with_done(b'data: {"content":"[DONE]"}\n\n')


def test_iter_events_cuts_like_splitting_on_blank_lines():
    """The lazy cutter yields exactly the blocks of the eager definition, CRLF included."""
    import random
    rnd = random.Random(7)
    pieces = [b"data: x", b"a", b"\n", b"\r\n", b"\r", b" ", b":c"]
    for _ in range(5000):
        data = b"".join(rnd.choice(pieces) for _ in range(rnd.randint(0, 24)))
        eager = [b for b in data.replace(b"\r\n", b"\n").split(b"\n\n") if b.strip()]
        assert list(iter_events(data)) == eager, data
    assert list(iter_events(b"data: 1\n\n\n\ndata: 2\r\n\r\n: c\n\n")) == [b"data: 1", b"data: 2", b": c"]
    first = next(iter_events(b"data: 1\n\n" + b"data: x\n\n" * 1000))
    assert first == b"data: 1"


def test_the_role_only_first_chunk_is_recognised_exactly_as_parsing_it_would():
    tail = b',"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}'
    lead = b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":17,"model":"m"'
    variants = [lead + tail, lead + b',"x":"a\\"b\\u00e9"' + tail, lead + b',"x":-1.5e3,"y":true' + tail,
                lead + b',"usage":{"prompt_tokens":1}' + tail, lead + b',"usage":null' + tail,
                lead + b',"error":{"message":"boom"}' + tail, lead.replace(b'"chat.completion.chunk"', b'"error"') + tail,
                lead[:-1] + tail, lead + b',"x":{"a":1}' + tail, lead + b',"x":"\xc3\xa9"' + tail,
                lead + b',"x":"\xff"' + tail, b"data: " + tail, b"data: {" + tail[1:], lead + b",\n" + tail[1:],
                lead + tail[:-3] + b',{"index":1,"delta":{"content":"x"}}]}', lead + tail + b"}"]
    for block in variants:
        parsed = classify(block.replace(b"data: ", b"data:  ", 1))  # one more space: only the JSON path
        assert classify(block) is parsed, block
    assert classify(lead + tail) is Kind.HOLD


def test_events_are_cut_as_if_every_crlf_were_lf_however_late_the_first_cr_comes():
    import itertools
    pieces = [b"\r", b"\n", b"a", b"\r\n", b"\n\n", b"data: x"]
    for n in range(6):
        for combo in itertools.product(pieces, repeat=n):
            data = b"".join(combo)
            flat = data.replace(b"\r\n", b"\n")
            want = [b for b in flat.split(b"\n\n") if b.strip()]
            assert list(iter_events(data)) == want, data
