"""SGLang's prefill/decode protocol through a real router, with the official ``openai`` client.

Static endpoints on real simulator processes in SGLang's dialect (``--disaggregation-mode``,
sim_disagg_sglang): a prefill endpoint names its bootstrap port, the decoder needs a prefill. Each
request goes to a prefill and the decoder at once, naming one room; the client gets the aggregated
answer. A prefill that fails before the decoder's first byte (every completion a 500, or no engine
at the address) abandons that decode try, whose engine stops waiting for the room, and the request
is served by another pair; with no prefill that can serve it the client gets 503 or 502, never a
decoder left waiting for KV that will not come.
"""

from __future__ import annotations

import openai
import pytest

from tests.integration.router_support import RouterProcess, openai_client, router_doc
from tests.integration.simdisagg_sglang import start_sglang
from tests.support.ports import free_port
from tests.support.polling import until

LONG = " ".join(f"w{i}" for i in range(300))
EXPECTED = "tok0 tok1 tok2 tok3 tok4 tok5"
SENT = "sglang:kv_transfer_latency_ms_count"  # the prefill engine's transfers
WAITING = "sglang:num_decode_transfer_queue_reqs"  # the decoder's requests waiting for their KV


def metric(url: str, name: str) -> float:
    import urllib.request
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        return sum(float(line.rsplit(" ", 1)[1]) for line in r.read().decode().splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))


@pytest.fixture(scope="module")
def sides(tmp_path_factory):
    logs = tmp_path_factory.mktemp("sglang-pd")
    started = []
    try:
        for mode, env in (("prefill", None), ("prefill", {"LLMGW_SIM_FAULT": "http-500"}), ("decode", None)):
            started.append(start_sglang(mode, logs, env=env))
        yield (*started, logs)
    finally:
        for s in started:
            s.stop()


def endpoint(side, eid: str, role: str) -> dict:
    ep = {"id": eid, "model": "m", "url": side.url, "role": role}
    return {**ep, "bootstrap_port": side.bootstrap_port} if role == "prefill" else {**ep, "requires_prefill": True}


def test_each_request_goes_to_a_prefill_and_the_decoder_at_once(sides):
    prefill, _, decode, logs = sides
    with RouterProcess(router_doc([endpoint(prefill, "p", "prefill"), endpoint(decode, "d", "decode")]),
                       tmp=logs) as router:
        client = openai_client(router)
        before = metric(prefill.url, SENT)
        assert client.completions.create(model="m", prompt=LONG, max_tokens=6).choices[0].text == EXPECTED
        chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": LONG}],
                                              max_tokens=6, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == EXPECTED
        # a short prompt too: an SGLang decoder cannot compute any prompt itself
        assert client.completions.create(model="m", prompt="hi", max_tokens=6).choices[0].text == EXPECTED
        assert metric(prefill.url, SENT) == before + 3
        assert router.metric("llmgw_router_prefill_decisions_total", model="m", decision="remote") == 3
        until(lambda: router.metric("llmgw_router_prefill_total", model="m", outcome="ok") == 3,
              "the three prefill answers read", on_timeout=router.output)


@pytest.mark.parametrize("bad", ["http-500", "nobody"])
def test_a_prefill_that_fails_first_abandons_its_decode_try_and_another_pair_serves(sides, bad):
    prefill, failing, decode, logs = sides
    if bad == "http-500":
        broken = endpoint(failing, "p-bad", "prefill")
    else:
        broken = {"id": "p-bad", "model": "m", "url": f"http://127.0.0.1:{free_port()}", "role": "prefill",
                  "bootstrap_port": free_port()}
    # the broken prefill is listed first: with both idle it is picked first
    eps = [broken, endpoint(prefill, "p", "prefill"), endpoint(decode, "d", "decode")]
    with RouterProcess(router_doc(eps), tmp=logs) as router:
        client = openai_client(router)
        for stream in (False, True, False, True):
            if stream:
                chunks = client.completions.create(model="m", prompt=LONG, max_tokens=6, stream=True)
                assert "".join(c.choices[0].text for c in chunks if c.choices) == EXPECTED
            else:
                assert client.completions.create(model="m", prompt=LONG, max_tokens=6).choices[0].text == EXPECTED
        assert router.metric("llmgw_router_prefill_total", model="m", outcome="failed") >= 1
        # the abandoned decode tries were aborted on the decoder (it waits for no room), and were
        # not counted against it (a try abandoned before it was sent is not counted at all)
        until(lambda: metric(decode.url, WAITING) == 0, "the decoder to stop waiting for abandoned rooms",
              on_timeout=router.output)
        assert router.metric("llmgw_router_upstream_attempts_total", model="m", endpoint="d", outcome="ok") == 4
        if bad == "http-500":
            # the decoder waits for a room that never comes: only the router's abandoning ends its try (with
            # no engine at the bootstrap address it may itself answer 500 first, as SGLang does at once)
            for outcome in ("status_5xx", "timeout", "first_token_timeout", "broken"):
                assert router.metric("llmgw_router_upstream_attempts_total", model="m", endpoint="d",
                                     outcome=outcome) == 0, outcome


def test_with_every_prefill_failing_the_client_is_told_and_the_decoder_freed(sides):
    _, failing, decode, logs = sides
    eps = [endpoint(failing, "p-bad", "prefill"), endpoint(decode, "d", "decode")]
    with RouterProcess(router_doc(eps), tmp=logs) as router:
        client = openai_client(router)
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model="m", prompt=LONG, max_tokens=6)
        # its one prefill endpoint was tried: the last try's failure is the client's answer
        assert e.value.status_code == 502 and e.value.body["code"] == "prefill_failed", e.value.body
        until(lambda: metric(decode.url, WAITING) == 0, "the decoder to stop waiting", on_timeout=router.output)


def test_without_a_prefill_endpoint_the_model_is_unavailable(sides):
    _, _, decode, logs = sides
    with RouterProcess(router_doc([endpoint(decode, "d", "decode")]), tmp=logs) as router:
        client = openai_client(router)
        before = metric(decode.url, "sglang:num_transfer_failed_reqs_total")
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model="m", prompt=LONG, max_tokens=6)
        assert e.value.status_code == 503 and e.value.body["code"] == "prefill_unavailable", e.value.body
        assert e.value.response.headers["retry-after"] == "1"
        assert router.metric("llmgw_router_prefill_decisions_total", model="m",
                             decision="no_prefill_endpoint") == 1
        assert metric(decode.url, "sglang:num_transfer_failed_reqs_total") == before  # the decoder never saw it
