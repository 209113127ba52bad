"""What an engine's failure means, without a process: the classification the proxy's suites exercise end to end."""

import json
from types import SimpleNamespace

import pytest

from llmgw.router.failures import (PENDING_RETRY_AFTER, classify_exception, endpoint_fault, model_not_ready,
                                   retry_delay, status_failure, total_timeout)
from llmgw.router.upstream import ConnectError

RT = SimpleNamespace(id="e0")


@pytest.mark.parametrize("status,fault", [(200, False), (400, False), (404, False), (401, True), (403, True),
                                          (429, True), (500, True), (503, True)])
def test_an_endpoint_fault_is_5xx_or_a_refusal_of_the_routers_key_or_back_pressure(status, fault):
    assert endpoint_fault(status) is fault


@pytest.mark.parametrize("value,delay", [("7", 7), (" 3 ", 3), (None, 1), ("", 1), ("-1", 1), ("1.5", 1),
                                         ("Wed, 21 Oct 2015 07:28:00 GMT", 1), ("1234567890", 1), ("٣", 1)])
def test_retry_after_is_taken_only_as_delay_seconds(value, delay):
    assert retry_delay(value) == delay


def test_an_engines_429_is_not_held_against_it_and_keeps_an_openai_body():
    f = status_failure(429, b'{"error": {"message": "busy"}}', RT, "rid1", "4")
    assert (f.outcome, f.counts, f.retryable) == ("rate_limited", False, True)
    assert f.upstream.status == 429 and f.upstream.headers["Retry-After"] == "4"
    assert json.loads(f.upstream.body) == {"error": {"message": "busy"}}
    plain = status_failure(429, b"busy", RT, "rid1", None)
    assert json.loads(plain.upstream.body)["error"]["code"] == "upstream_rate_limited"
    assert plain.upstream.headers["Retry-After"] == "1"


def test_a_5xx_body_stays_out_of_the_clients_answer():
    f = status_failure(500, b"Traceback: /secret/path", RT, "rid1", None)
    assert (f.outcome, f.counts, f.error.status) == ("status_5xx", True, 502)
    assert "secret" not in f.error.message and "rid1" in f.error.message
    assert status_failure(401, b"", RT, "rid1", None).outcome == "engine_auth"


def test_exceptions_are_classified_and_a_bug_is_raised_again():
    assert classify_exception(ConnectError("refused"), RT, "per-try timeout").outcome == "connect"
    assert classify_exception(TimeoutError(), RT, "per-try timeout").error.status == 504
    assert classify_exception(ConnectionResetError(), RT, "per-try timeout").outcome == "broken"
    with pytest.raises(KeyError):
        classify_exception(KeyError("bug"), RT, "per-try timeout")


def test_the_requests_own_deadline_is_not_the_endpoints_fault_and_ends_the_retries():
    f = total_timeout(RT)
    assert (f.counts, f.retryable, f.error.status) == (False, False, 504)


def test_a_model_not_yet_reported_is_retried_soon():
    assert model_not_ready("m", 0.2).retry_after == 1
    assert model_not_ready("m", 30).retry_after == PENDING_RETRY_AFTER
