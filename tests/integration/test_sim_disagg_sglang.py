"""Prefill/decode disaggregation in the simulator's SGLang dialect, driven as a router drives SGLang.

Real simulator processes: an aggregated one (mode null) for reference, a ``--disaggregation-mode
prefill`` one serving its bootstrap server, a ``decode`` one. Each pair's two requests go out at
once with the same ``bootstrap_host``/``bootstrap_port``/``bootstrap_room``: the prefill answers one
token once the decoder has its KV, the decoder answers what the aggregated engine answers. A transfer
that cannot happen (no prefill, no decoder, an unreachable bootstrap server, a prompt of another
length, a broken fabric on either side) is a 500 counted in SGLang's metrics, and the decoder serves on.
"""

from __future__ import annotations

import threading
import urllib.error
from concurrent.futures import ThreadPoolExecutor

import pytest

from llmgw.kvbootstrap import new_room
from tests.integration.simdisagg import metric
from tests.integration.simdisagg_sglang import (
    FAKE_BOOTSTRAP_HOST,
    pair,
    post,
    start_sglang,
    streamed_text,
)
from tests.support.polling import until
from tests.support.ports import closed_port

PROMPT = " ".join(f"w{i}" for i in range(64))
TOKENS8 = "tok0 tok1 tok2 tok3 tok4 tok5 tok6 tok7"
LATENCY = "sglang:kv_transfer_latency_ms_count"
BOOTSTRAP_FAILED = "sglang:num_bootstrap_failed_reqs_total"
TRANSFER_FAILED = "sglang:num_transfer_failed_reqs_total"
BOOTSTRAP_QUEUE = "sglang:num_prefill_bootstrap_queue_reqs"
TRANSFER_QUEUE = "sglang:num_decode_transfer_queue_reqs"
CHUNKS = "llmgw_sim:prefill_chunks_total"  # prefill steps taken (sim_interference)
TIMING = {"LLMGW_SIM_PREFILL_TOKEN_LATENCY": "0.001", "LLMGW_SIM_KV_TRANSFER_TOKEN_LATENCY": "0.0001"}


@pytest.fixture(scope="module")
def sides(tmp_path_factory):
    """(aggregated, prefill, decode), the pair's timeouts SGLang's defaults."""
    logs = tmp_path_factory.mktemp("sglang-pd")
    started = []
    try:
        for mode in ("null", "prefill", "decode"):
            started.append(start_sglang(mode, logs, env=TIMING))
        yield tuple(started)
    finally:
        for side in started:
            side.stop()


@pytest.fixture(scope="module")
def impatient(tmp_path_factory):
    """(prefill, decode) whose rooms wait one second for the other side."""
    logs = tmp_path_factory.mktemp("sglang-pd-impatient")
    prefill = start_sglang("prefill", logs, env={**TIMING, "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "1"})
    try:
        decode = start_sglang("decode", logs, env={**TIMING, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "1"})
    except BaseException:
        prefill.stop()
        raise
    try:
        yield prefill, decode
    finally:
        decode.stop()
        prefill.stop()


def body(max_tokens: int = 8, prompt: str = PROMPT, **extra) -> dict:
    return {"model": "m", "prompt": prompt, "max_tokens": max_tokens, **extra}


def chat(max_tokens: int = 8, **extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens, **extra}


def assert_sglang_500(doc: dict, says: str) -> None:
    assert doc["object"] == "error" and doc["code"] == 500, doc
    assert says in doc["message"], doc


def assert_decoder_serves(prefill, decode) -> None:
    room = new_room()
    (ps, _), (ds, doc) = pair(prefill.url, decode.url, body(1, **prefill.bootstrap(room)),
                              body(4, **prefill.bootstrap(room)))
    assert (ps, ds) == (200, 200) and doc["choices"][0]["text"] == "tok0 tok1 tok2 tok3", doc
    assert decode.sim.health_status() == 200


# ------------------------------------------------------------------------------ a transfer

def test_a_pair_answers_what_an_aggregated_engine_answers(sides):
    agg, prefill, decode = sides
    sent = metric(prefill.url, LATENCY)
    chunks = (metric(prefill.url, CHUNKS), metric(decode.url, CHUNKS))
    room = new_room()
    (ps, pdoc), (ds, ddoc) = pair(prefill.url, decode.url, body(1, **prefill.bootstrap(room)),
                                  body(8, **prefill.bootstrap(room)))
    assert ps == 200 and pdoc["choices"][0]["text"] == "tok0" and pdoc["usage"]["completion_tokens"] == 1, pdoc
    assert ds == 200, ddoc
    _, plain = post(agg.url, body(8))
    assert ddoc["choices"][0]["text"] == plain["choices"][0]["text"] == TOKENS8
    assert ddoc["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] == 64
    assert ddoc["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert metric(prefill.url, LATENCY) == sent + 1
    assert metric(prefill.url, BOOTSTRAP_QUEUE) == 0 and metric(decode.url, TRANSFER_QUEUE) == 0
    # the prompt was prefilled once, on the prefill side: the decoder got its KV instead
    assert (metric(prefill.url, CHUNKS), metric(decode.url, CHUNKS)) == (chunks[0] + 1, chunks[1])


def test_a_streamed_decode_streams_the_aggregated_chunks(sides):
    agg, prefill, decode = sides
    room = new_room()
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    (ps, _), (ds, events) = pair(prefill.url, decode.url, body(1, **prefill.bootstrap(room)),
                                 body(8, **stream, **prefill.bootstrap(room)))
    _, plain = post(agg.url, body(8, **stream))
    assert (ps, ds) == (200, 200)
    assert streamed_text(events) == streamed_text(plain) == TOKENS8
    assert events[-1] == "[DONE]" and events[-2]["usage"] == plain[-2]["usage"]


def test_a_chat_pair_answers_the_aggregated_message(sides):
    agg, prefill, decode = sides
    room = new_room()
    (ps, pdoc), (ds, ddoc) = pair(prefill.url, decode.url, chat(1, **prefill.bootstrap(room)),
                                  chat(8, stream=True, **prefill.bootstrap(room)), path="/v1/chat/completions")
    _, plain = post(agg.url, chat(8), path="/v1/chat/completions")
    assert ps == 200 and pdoc["usage"]["completion_tokens"] == 1, pdoc
    assert ds == 200 and streamed_text(ddoc, chat=True) == plain["choices"][0]["message"]["content"] == TOKENS8


@pytest.mark.parametrize("first", ["prefill", "decode"])
def test_either_side_may_arrive_first_and_waits_in_its_queue(sides, first):
    _, prefill, decode = sides
    room = new_room()
    early, late = ((prefill, body(1, **prefill.bootstrap(room))), (decode, body(4, **prefill.bootstrap(room))))
    gauge = BOOTSTRAP_QUEUE
    if first == "decode":
        early, late = late, early
        gauge = TRANSFER_QUEUE
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(post, early[0].url, early[1])
        until(lambda: metric(early[0].url, gauge) == 1, f"the {first} request queued for its peer")
        assert not waiting.done()
        late_status, _ = post(late[0].url, late[1])
        early_status, _ = waiting.result()
    assert (early_status, late_status) == (200, 200)
    assert metric(early[0].url, gauge) == 0


# ------------------------------------------------------------------------------ no transfer

def test_the_fake_bootstrap_host_needs_no_peer(sides):
    agg, prefill, decode = sides
    fake = {"bootstrap_host": FAKE_BOOTSTRAP_HOST, "bootstrap_room": 0}  # SGLang's /health_generate
    sent = metric(prefill.url, LATENCY)
    status, doc = post(prefill.url, body(8, **fake))
    assert status == 200 and doc["choices"][0]["text"] == "tok0", doc
    status, doc = post(decode.url, body(8, **fake))
    assert status == 200 and doc["choices"][0]["text"] == TOKENS8, doc
    assert metric(prefill.url, LATENCY) == sent  # no transfer to time


def test_a_decode_without_bootstrap_fields_cannot_prefill(sides):
    _, _, decode = sides
    before = metric(decode.url, BOOTSTRAP_FAILED)
    status, doc = post(decode.url, body(4))
    assert status == 500
    assert_sglang_500(doc, "bootstrap_host, bootstrap_port, bootstrap_room missing")
    assert metric(decode.url, BOOTSTRAP_FAILED) == before + 1
    assert decode.sim.health_status() == 200


def test_a_prefill_needs_a_room(sides):
    _, prefill, _ = sides
    status, doc = post(prefill.url, body(1, bootstrap_host="127.0.0.1", bootstrap_port=prefill.bootstrap_port))
    assert status == 400 and "bootstrap_room" in doc["message"], doc
    status, doc = post(prefill.url, body(1, bootstrap_room=[1, 2]))
    assert status == 400, doc


# ------------------------------------------------------------------------------ failed transfers

def test_an_unreachable_bootstrap_server_is_a_bootstrap_failure(sides):
    _, prefill, decode = sides
    before = (metric(decode.url, BOOTSTRAP_FAILED), metric(decode.url, TRANSFER_FAILED))
    status, doc = post(decode.url, body(4, bootstrap_host="127.0.0.1", bootstrap_port=closed_port(),
                                        bootstrap_room=new_room()))
    assert status == 500
    assert_sglang_500(doc, "Decode handshake failed")
    assert (metric(decode.url, BOOTSTRAP_FAILED), metric(decode.url, TRANSFER_FAILED)) == (before[0] + 1, before[1])
    assert_decoder_serves(prefill, decode)


def test_a_prompt_of_another_length_fails_both_sides(sides):
    _, prefill, decode = sides
    before = (metric(prefill.url, TRANSFER_FAILED), metric(decode.url, TRANSFER_FAILED))
    room = new_room()
    (ps, pdoc), (ds, ddoc) = pair(prefill.url, decode.url, body(1, **prefill.bootstrap(room)),
                                  body(4, prompt=PROMPT + " extra", **prefill.bootstrap(room)))
    assert (ps, ds) == (500, 500)
    assert_sglang_500(pdoc, "Prefill transfer failed")
    assert_sglang_500(ddoc, "made room for 65 prompt tokens, this prefill has 64")
    assert (metric(prefill.url, TRANSFER_FAILED), metric(decode.url, TRANSFER_FAILED)) == (before[0] + 1,
                                                                                          before[1] + 1)
    assert_decoder_serves(prefill, decode)


def test_a_room_is_one_shot(sides):
    _, prefill, decode = sides
    room = new_room()
    (ps, _), (ds, _) = pair(prefill.url, decode.url, body(1, **prefill.bootstrap(room)),
                            body(4, **prefill.bootstrap(room)))
    assert (ps, ds) == (200, 200)
    before = metric(decode.url, TRANSFER_FAILED)
    status, doc = post(decode.url, body(4, **prefill.bootstrap(room)))
    assert status == 500
    assert_sglang_500(doc, "one-shot")
    assert metric(decode.url, TRANSFER_FAILED) == before + 1


def test_a_decode_whose_prefill_never_comes_fails_after_the_waiting_timeout(impatient):
    prefill, decode = impatient
    before = metric(decode.url, TRANSFER_FAILED)
    room = new_room()
    status, doc = post(decode.url, body(4, **prefill.bootstrap(room)))
    assert status == 500
    assert_sglang_500(doc, "KVPoll.WaitingForInput")
    assert metric(decode.url, TRANSFER_FAILED) == before + 1 and metric(decode.url, TRANSFER_QUEUE) == 0
    # the room closed with the claim: its prefill, come late, fails at once instead of waiting a decoder
    failed = metric(prefill.url, BOOTSTRAP_FAILED)
    status, doc = post(prefill.url, body(1, **prefill.bootstrap(room)))
    assert status == 500 and "one-shot" in doc["message"], doc
    assert metric(prefill.url, BOOTSTRAP_FAILED) == failed + 1
    assert_decoder_serves(prefill, decode)


def test_a_prefill_whose_decoder_never_claims_fails_after_the_bootstrap_timeout(impatient):
    prefill, decode = impatient
    before = metric(prefill.url, BOOTSTRAP_FAILED)
    room = new_room()
    status, doc = post(prefill.url, body(1, **prefill.bootstrap(room)))
    assert status == 500
    assert_sglang_500(doc, "KVPoll.Bootstrapping")
    assert metric(prefill.url, BOOTSTRAP_FAILED) == before + 1 and metric(prefill.url, BOOTSTRAP_QUEUE) == 0
    assert_decoder_serves(prefill, decode)


@pytest.mark.parametrize("broken", ["prefill", "decode"])
def test_a_broken_fabric_fails_the_transfer(sides, tmp_path, broken):
    _, prefill, decode = sides
    side = start_sglang(broken, tmp_path, env={**TIMING, "LLMGW_SIM_FAULT": "kv-transfer-fail"})
    try:
        p, d = (side, decode) if broken == "prefill" else (prefill, side)
        before = metric(d.url, TRANSFER_FAILED)
        room = new_room()
        (ps, _), (ds, doc) = pair(p.url, d.url, body(1, **p.bootstrap(room)), body(4, **p.bootstrap(room)))
        assert (ps, ds) == (500, 500)
        assert_sglang_500(doc, "Decode transfer failed")
        assert "fabric is down" in doc["message"]
        assert metric(d.url, TRANSFER_FAILED) == before + 1
        assert side.sim.health_status() == 200
        if broken == "prefill":
            assert_decoder_serves(prefill, decode)
        else:  # the broken decoder still serves what needs no fabric
            status, doc = post(side.url, body(4, bootstrap_host=FAKE_BOOTSTRAP_HOST, bootstrap_room=0))
            assert status == 200 and doc["choices"][0]["text"] == "tok0 tok1 tok2 tok3", doc
    finally:
        side.stop()


# ------------------------------------------------------------------------------ clients that leave

@pytest.mark.parametrize("leaving", ["prefill", "decode"])
def test_a_client_that_leaves_while_waiting_frees_its_room(sides, leaving):
    _, prefill, decode = sides
    room = new_room()
    side, gauge = (prefill, BOOTSTRAP_QUEUE) if leaving == "prefill" else (decode, TRANSFER_QUEUE)
    other = decode if leaving == "prefill" else prefill
    gone = threading.Event()

    def wait_then_leave() -> None:
        try:
            post(side.url, body(4, **prefill.bootstrap(room)), timeout=1)
        except (urllib.error.URLError, TimeoutError):
            gone.set()

    leaver = threading.Thread(target=wait_then_leave)
    leaver.start()
    leaver.join()
    assert gone.is_set(), "the request was answered while its peer never came"
    until(lambda: metric(side.url, gauge) == 0, f"the {leaving} side freeing the room its client left")
    # the room went with the client: the other side's request for it fails instead of waiting its timeout
    status, doc = post(other.url, body(4, **prefill.bootstrap(room)))
    assert status == 500 and f"bootstrap_room={room}" in doc["message"], doc
    assert_decoder_serves(prefill, decode)
