"""vLLM's sleep mode in the engine simulator, through a real simulator process over HTTP.

Scale-to-sleep needs engines that sleep and wake as vLLM's do: the dev-mode
routes, requests refused (503) while asleep and served again once awake,
the running ones finished, the configured times honoured, and a clear
refusal without ``--enable-sleep-mode``.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from simproc import start_sim

from tests.support.polling import until

pytestmark = pytest.mark.integration

DEV = {"VLLM_SERVER_DEV_MODE": "1"}
TIMES = {"LLMGW_SIM_SLEEP_TIME": "0.05", "LLMGW_SIM_WAKE_TIME": "0.2", "LLMGW_SIM_WAKE_TIME_LEVEL2": "0.4",
         "LLMGW_SIM_TOKEN_LATENCY": "0.02"}


def call(sim, method: str, path: str) -> tuple[int, dict | None]:
    req = urllib.request.Request(f"{sim.url}{path}", method=method, data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            body = resp.read()
            return resp.status, json.loads(body) if body else None
    except urllib.error.HTTPError as e:
        body = e.read()
        return e.code, json.loads(body) if body else None


def running_requests(sim) -> float:
    text = urllib.request.urlopen(f"{sim.url}/metrics", timeout=10).read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "vllm:num_requests_running")


def sleeping(sim) -> bool:
    status, body = call(sim, "GET", "/is_sleeping")
    assert status == 200, (status, body)
    return body["is_sleeping"]


def complete(sim, **kw):
    c = openai.OpenAI(base_url=sim.base_url, api_key="unused", max_retries=0, timeout=30)
    return c.completions.create(model="m", prompt="hello", max_tokens=kw.pop("max_tokens", 4), **kw)


def test_sleep_refuses_new_requests_finishes_running_ones_and_wake_serves_again(tmp_path):
    with start_sim(env={**DEV, **TIMES}, extra_args=["--enable-sleep-mode"], log_dir=tmp_path) as sim:
        assert not sleeping(sim)
        assert complete(sim).choices[0].text

        # a request running when the sleep begins finishes
        running: dict = {}
        t = threading.Thread(target=lambda: running.setdefault("r", complete(sim, max_tokens=30)))
        t.start()
        until(lambda: running_requests(sim) >= 1, "the long request to be running")
        assert call(sim, "POST", "/sleep?level=1") == (200, None)
        t.join(30)
        assert running["r"].choices[0].finish_reason == "length"

        assert sleeping(sim)
        with pytest.raises(openai.APIStatusError) as e:
            complete(sim)
        assert e.value.status_code == 503 and "sleeping" in e.value.message
        assert urllib.request.urlopen(f"{sim.url}/health", timeout=10).status == 200  # not judged dead
        assert call(sim, "POST", "/sleep?level=1")[0] == 200  # again: a no-op

        # one part awake is not awake
        assert call(sim, "POST", "/wake_up?tags=kv_cache")[0] == 200
        assert sleeping(sim)
        began = time.monotonic()
        assert call(sim, "POST", "/wake_up")[0] == 200
        assert time.monotonic() - began >= 0.2  # LLMGW_SIM_WAKE_TIME: the weights came back
        assert not sleeping(sim)
        assert complete(sim).choices[0].text

        # level 2 drops the weights: waking reads them again
        assert call(sim, "POST", "/sleep?level=2")[0] == 200
        began = time.monotonic()
        assert call(sim, "POST", "/wake_up?tags=weights&tags=kv_cache")[0] == 200
        assert time.monotonic() - began >= 0.4
        assert complete(sim).choices[0].text

        for path in ("/sleep?level=3", "/sleep?level=x", "/wake_up?tags=optimizer"):
            status, body = call(sim, "POST", path)
            assert status == 400 and body["error"]["code"] == 400, (path, status, body)


def test_without_the_flag_sleep_is_refused_and_without_dev_mode_there_is_no_route(tmp_path):
    with start_sim(env=DEV, log_dir=tmp_path) as no_flag, start_sim(log_dir=tmp_path) as no_dev:
        status, body = call(no_flag, "POST", "/sleep")
        assert status == 400 and "--enable-sleep-mode" in body["error"]["message"]
        assert not sleeping(no_flag)
        assert call(no_dev, "POST", "/sleep")[0] == 404
        assert call(no_dev, "GET", "/is_sleeping")[0] == 404
