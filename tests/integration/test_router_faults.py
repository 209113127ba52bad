"""Failure handling with real processes: the router binary, simulated engines, the openai client."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import openai
import pytest
import yaml

from router_support import Blackhole, CountingServer, RouterProcess, SSEServer, openai_client, router_doc, start_sims

from tests.support.polling import until
from tests.support.ports import closed_port

pytestmark = pytest.mark.integration

MSG = [{"role": "user", "content": "hello"}]
TOKENS = [f"tok{i}" if i == 0 else f" tok{i}" for i in range(64)]


def endpoints(urls):
    return [{"id": name, "model": "m", "url": url} for name, url in urls]


def stream_text(client, max_tokens=8):
    """(content pieces received, exception or None) of one streaming chat request."""
    pieces: list[str] = []
    try:
        for ev in client.chat.completions.create(model="m", messages=MSG, stream=True, max_tokens=max_tokens):
            if ev.choices and ev.choices[0].delta.content:
                pieces.append(ev.choices[0].delta.content)
    except openai.APIError as e:
        return pieces, e
    return pieces, None


@pytest.mark.parametrize("fault", ["refused", "http-500"])
def test_one_failing_endpoint_of_four_is_ejected(fault, tmp_path):
    sims = start_sims(3 if fault == "refused" else 4,
                      envs=None if fault == "refused" else [{}, {}, {}, {"LLMGW_SIM_FAULT": "http-500"}])
    try:
        bad_url = f"http://127.0.0.1:{closed_port()}" if fault == "refused" else sims[3].url
        urls = [(f"ok{i}", sims[i].url) for i in range(3)] + [("bad", bad_url)]
        doc = router_doc(endpoints(urls), outlier={"consecutive_errors": 3, "base_ejection": 300, "max_ejection": 300})
        with RouterProcess(doc, tmp=tmp_path) as r:
            c = openai_client(r)
            errors = 0
            for i in range(40):
                try:
                    if i % 2:
                        assert len(stream_text(c)[0]) == 8
                    else:
                        assert c.chat.completions.create(model="m", messages=MSG, max_tokens=2).choices
                except openai.APIError:
                    errors += 1
            # the bad endpoint was tried exactly until it was ejected, never again
            assert r.metric("llmgw_router_ejections_total", endpoint="bad") == 1
            bad_attempts = r.metric("llmgw_router_upstream_attempts_total", endpoint="bad")
            assert bad_attempts == 3
            # a client saw an error only where the retry budget refused the retry
            assert errors == r.metric("llmgw_router_retries_denied_total")
            assert r.metric("llmgw_router_retries_total") == 3 - errors
    finally:
        for s in sims:
            s.stop()


def test_all_endpoints_failing_does_not_amplify_the_load(tmp_path):
    servers = [CountingServer(500) for _ in range(4)]
    try:
        doc = router_doc(endpoints([(f"e{i}", s.url) for i, s in enumerate(servers)]),
                         retries={"budget_window": 600},
                         outlier={"consecutive_errors": 5, "base_ejection": 1, "max_ejection": 2})
        with RouterProcess(doc, tmp=tmp_path) as r:
            c = openai_client(r)
            n = 60
            statuses = []
            for _ in range(n):
                with pytest.raises(openai.APIStatusError) as ei:
                    c.chat.completions.create(model="m", messages=MSG)
                statuses.append(ei.value.status_code)
            assert set(statuses) <= {502, 503}
            upstream = sum(s.count for s in servers)
            assert upstream <= 1.2 * n, f"{upstream} upstream attempts for {n} client requests"
            assert upstream == r.metric("llmgw_router_upstream_attempts_total")
    finally:
        for s in servers:
            s.close()


def test_model_with_every_endpoint_ejected_answers_503_without_trying(tmp_path):
    servers = [CountingServer(500) for _ in range(2)]
    try:
        doc = router_doc(endpoints([(f"e{i}", s.url) for i, s in enumerate(servers)]),
                         outlier={"consecutive_errors": 2, "base_ejection": 300, "max_ejection": 300,
                                  "max_ejection_share": 1.0})
        with RouterProcess(doc, tmp=tmp_path) as r:
            c = openai_client(r)
            for _ in range(20):
                with pytest.raises(openai.APIStatusError) as ei:
                    c.chat.completions.create(model="m", messages=MSG)
                if ei.value.status_code == 503:
                    break
            assert ei.value.status_code == 503 and ei.value.body["code"] == "no_healthy_endpoint"
            assert ei.value.response.headers["Retry-After"] == "1"
            before = sum(s.count for s in servers)
            for _ in range(10):
                with pytest.raises(openai.InternalServerError):
                    c.chat.completions.create(model="m", messages=MSG)
            assert sum(s.count for s in servers) == before
    finally:
        for s in servers:
            s.close()


@pytest.mark.parametrize("n", [0, 1, 5])
def test_engine_dying_mid_stream(n, tmp_path):
    env = {"LLMGW_SIM_TOKEN_LATENCY": "0.02", "LLMGW_SIM_OUTPUT_TOKENS": "8"}
    dying, healthy = start_sims(2, envs=[dict(env, LLMGW_SIM_FAULT=f"crash-after:{n}"), env])
    try:
        doc = router_doc(endpoints([("dying", dying.url), ("healthy", healthy.url)]))
        with RouterProcess(doc, tmp=tmp_path) as r:
            c = openai_client(r)
            results = []
            # Until a request landed on the dying engine (a fair coin each time), and not one more:
            # a request sent while the crashed engine's process is still being torn down may meet a
            # socket that accepts and then resets, a retry this test does not count.
            for _ in range(40):
                results.append(stream_text(c))
                if results[-1][1] is not None or (n == 0 and r.metric("llmgw_router_retries_total",
                                                                      reason="broken")):
                    break
            until(lambda: not dying.alive(), "the crashing engine to exit", 30, interval=0.05)
            failed = [(p, e) for p, e in results if e is not None]
            if n == 0:
                # nothing had reached the client: retried on the healthy engine, invisibly
                assert failed == []
                assert r.metric("llmgw_router_retries_total", reason="broken") == 1
            else:
                # one stream broke after n tokens: it ends with an explicit error, no token twice
                assert len(failed) == 1
                pieces, err = failed[0]
                assert pieces == TOKENS[:n]
                assert err.body["code"] == "upstream_stream_broken"
                # (a later request may meet the dead port and be retried: that is "connect", not this)
                assert r.metric("llmgw_router_retries_total", reason="broken") == 0
            for pieces, err in results:
                if err is None:
                    assert pieces == TOKENS[:8]
    finally:
        dying.stop()
        healthy.stop()


@pytest.mark.parametrize("n", [0, 2])
def test_inband_error_chunk(n, tmp_path):
    env = {"LLMGW_SIM_TOKEN_LATENCY": "0.02", "LLMGW_SIM_OUTPUT_TOKENS": "8"}
    faulty, healthy = start_sims(2, envs=[dict(env, LLMGW_SIM_FAULT=f"error-chunk-after:{n}"), env])
    try:
        doc = router_doc(endpoints([("faulty", faulty.url), ("healthy", healthy.url)]),
                         outlier={"consecutive_errors": 2, "base_ejection": 300, "max_ejection": 300})
        with RouterProcess(doc, tmp=tmp_path) as r:
            c = openai_client(r)
            results = []
            for _ in range(60):
                results.append(stream_text(c))
                if r.metric("llmgw_router_ejections_total", endpoint="faulty"):
                    break
            # an in-band error on a 200 stream counted as the engine failing
            assert r.metric("llmgw_router_ejections_total", endpoint="faulty") == 1
            inband = r.metric("llmgw_router_upstream_attempts_total", endpoint="faulty", outcome="inband_error")
            assert inband >= 2  # consecutive_errors (a request may reach it before the last one is recorded)
            failed = [(p, e) for p, e in results if e is not None]
            if n == 0:
                assert failed == []  # before the first token: retried
            else:
                assert len(failed) == inband  # each error the client saw is one the engine sent
                for pieces, err in failed:
                    assert pieces == TOKENS[:n]
                    assert "EngineCore" in err.message  # the engine's own error, relayed
            for pieces, err in results:
                if err is None:
                    assert pieces == TOKENS[:8]
            after = [stream_text(c) for _ in range(5)]
            assert all(e is None and p == TOKENS[:8] for p, e in after)
    finally:
        faulty.stop()
        healthy.stop()


def hung_and_healthy_doc(hung, healthy) -> dict:
    """Router config for a hung engine beside a healthy one: two failures eject it, for longer than a test."""
    return router_doc(endpoints([("hung", hung.url), ("healthy", healthy.url)]),
                      timeouts={"first_token": 1.5, "per_try": 3},
                      outlier={"consecutive_errors": 2, "base_ejection": 300, "max_ejection": 300})


def test_hung_engine_with_healthy_health_check_leaves_rotation(tmp_path):
    hung, healthy = start_sims(2, envs=[{"LLMGW_SIM_FAULT": "hang"}, {"LLMGW_SIM_OUTPUT_TOKENS": "4"}])
    try:
        doc = hung_and_healthy_doc(hung, healthy)
        with RouterProcess(doc, tmp=tmp_path) as r:
            c = openai_client(r)
            for i in range(40):
                if i % 2:
                    pieces, err = stream_text(c, max_tokens=4)
                    assert err is None and pieces == TOKENS[:4]
                else:
                    assert c.chat.completions.create(model="m", messages=MSG, max_tokens=4).choices
                if r.metric("llmgw_router_ejections_total", endpoint="hung"):
                    break
            assert hung.health_status() == 200  # its health check never noticed
            assert r.metric("llmgw_router_ejections_total", endpoint="hung") == 1
            timeouts = (r.metric("llmgw_router_upstream_attempts_total", endpoint="hung",
                                 outcome="first_token_timeout")
                        + r.metric("llmgw_router_upstream_attempts_total", endpoint="hung", outcome="timeout"))
            assert timeouts == 2
            assert_out_of_rotation(r, c, "hung")
    finally:
        hung.stop()
        healthy.stop()


def assert_out_of_rotation(r, client, endpoint: str) -> None:
    """Ten more streams all succeed without a single attempt on ``endpoint``."""
    before = r.metric("llmgw_router_upstream_attempts_total", endpoint=endpoint)
    for _ in range(10):
        assert stream_text(client, max_tokens=4) == (TOKENS[:4], None)
    assert r.metric("llmgw_router_upstream_attempts_total", endpoint=endpoint) == before


def test_blackholed_endpoint_does_not_hold_up_healthy_ones(tmp_path):
    sims = start_sims(3, env={"LLMGW_SIM_TOKEN_LATENCY": "0.01", "LLMGW_SIM_OUTPUT_TOKENS": "8"})
    hole = Blackhole()
    try:
        urls = [(f"ok{i}", s.url) for i, s in enumerate(sims)] + [("hole", hole.url)]
        # per-try far beyond the test: requests held by the blackhole stay held until it resets them
        doc = router_doc(endpoints(urls), access_log=False, timeouts={"per_try": 600, "first_token": 600},
                         retries={"budget_min": 100})
        with RouterProcess(doc, tmp=tmp_path) as r:
            done: list[tuple[list[str], Exception | None]] = []
            lock = threading.Lock()

            def one():
                with openai_client(r) as c:
                    res = stream_text(c)
                with lock:
                    done.append(res)

            threads = [threading.Thread(target=one) for _ in range(24)]
            for t in threads:
                t.start()
            # every request not caught by the blackhole completes while it still holds its catch
            until(lambda: hole.open_connections >= 1 and len(done) + hole.open_connections == 24,
                  "healthy requests to finish beside the blackhole", 120, interval=0.05)
            held = hole.open_connections
            assert 1 <= held < 24
            assert all(e is None and p == TOKENS[:8] for p, e in done)
            assert hole.open_connections == held  # nothing timed out: the healthy ones did not wait on it
            hole.release()  # now the blackhole resets them: retried elsewhere, before any byte was sent
            for t in threads:
                t.join(120)
            bad = [(p, e) for p, e in done if e is not None or p != TOKENS[:8]]
            assert len(done) == 24 and not bad, bad
            assert r.metric("llmgw_router_upstream_attempts_total", endpoint="hole") == held
    finally:
        hole.close()
        for s in sims:
            s.stop()


ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'


def sse_token(text: str) -> bytes:
    return b'data: {"choices":[{"index":0,"delta":{"content":"%s"},"finish_reason":null}]}\n\n' % text.encode()


def test_impatient_clients_do_not_keep_a_hung_engine_in_rotation(tmp_path):
    # clients give up (0.5 s) long before the first-token timeout (1.5 s): the router still waits
    # for the hung engine's verdict, so the engine is found out and ejected all the same
    hung, healthy = start_sims(2, envs=[{"LLMGW_SIM_FAULT": "hang"}, {"LLMGW_SIM_OUTPUT_TOKENS": "4"}])
    try:
        doc = hung_and_healthy_doc(hung, healthy)
        with RouterProcess(doc, tmp=tmp_path) as r:
            impatient = openai_client(r, timeout=0.5)
            gave_up = 0
            deadline = time.monotonic() + 30
            while not r.metric("llmgw_router_ejections_total", endpoint="hung"):
                assert time.monotonic() < deadline, "the hung engine was never ejected"
                pieces, err = stream_text(impatient, max_tokens=4)
                if err is not None:
                    assert isinstance(err, openai.APITimeoutError)
                    gave_up += 1
                else:
                    assert pieces == TOKENS[:4]
            assert gave_up >= 2 and hung.health_status() == 200
            assert r.metric("llmgw_router_upstream_attempts_total", endpoint="hung",
                            outcome="first_token_timeout") == 2
            assert r.metric("llmgw_router_upstream_attempts_total", endpoint="hung", outcome="cancelled") == 0
            assert_out_of_rotation(r, impatient, "hung")
    finally:
        hung.stop()
        healthy.stop()


def test_sse_comments_do_not_keep_a_stalled_stream_alive(tmp_path):
    # one token, then only keep-alive comments for 20 s: the inter-token watchdog must cut it
    engine = SSEServer([(0, ROLE), (0, sse_token("t0"))] + [(0.1, b": keepalive\n\n")] * 200)
    try:
        doc = router_doc(endpoints([("e", engine.url)]), timeouts={"inter_token": 1})
        with RouterProcess(doc, tmp=tmp_path) as r:
            t = time.monotonic()
            pieces, err = stream_text(openai_client(r))
            assert time.monotonic() - t < 10
            assert pieces == ["t0"] and err is not None and err.body["code"] == "upstream_stream_stalled"
            assert r.metric("llmgw_router_upstream_attempts_total", outcome="inter_token_timeout") == 1
    finally:
        engine.close()


def test_done_before_any_output_is_not_a_successful_empty_completion(tmp_path):
    empty = SSEServer([(0, ROLE), (0, b": ping\n\n"), (0, b"data: [DONE]\n\n")])
    (sim,) = start_sims(1, env={"LLMGW_SIM_OUTPUT_TOKENS": "8"})
    try:
        with RouterProcess(router_doc(endpoints([("empty", empty.url)])), tmp=tmp_path) as r:
            with pytest.raises(openai.APIStatusError) as ei:
                for _ in openai_client(r).chat.completions.create(model="m", messages=MSG, stream=True):
                    pass
            assert ei.value.status_code == 502 and ei.value.body["code"] == "upstream_stream_broken"
        doc = router_doc(endpoints([("empty", empty.url), ("ok", sim.url)]), retries={"budget_min": 100})
        with RouterProcess(doc, tmp=tmp_path) as r:
            c = openai_client(r)
            for _ in range(40):  # until one request met the empty engine: retried, invisibly
                assert stream_text(c) == (TOKENS[:8], None)
                if r.metric("llmgw_router_retries_total", reason="broken"):
                    break
            assert r.metric("llmgw_router_retries_total", reason="broken") >= 1
            assert r.metric("llmgw_router_upstream_attempts_total", endpoint="empty", outcome="broken") >= 1
    finally:
        empty.close()
        sim.stop()


def test_static_endpoint_with_an_invalid_port_is_a_config_error(tmp_path):
    doc = router_doc(endpoints([("bad", "http://127.0.0.1:99999")]))
    cfg = tmp_path / "router.yaml"
    cfg.write_text(yaml.safe_dump({"listen": {"host": "127.0.0.1", "port": 0}, **doc}))
    run = subprocess.run([sys.executable, "-m", "llmgw.router", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "/static_endpoints/0/url" in run.stderr + run.stdout and "99999" in run.stderr + run.stdout
    assert "Traceback" not in run.stderr
    check = subprocess.run([sys.executable, "-m", "llmgw", "config", "validate", "--kind", "router", str(cfg)],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 1 and "/static_endpoints/0/url" in check.stderr
