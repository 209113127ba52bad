"""Talking to a simulator that is one side of a prefill/decode pair: its connector flags, a completion, a metric,
and load kept up while a fault strikes a pair."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable

from tests.support.polling import until


def xfer_config(role: str, policy: str = "fail") -> list[str]:
    return ["--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": role,
                                                "kv_buffer_device": "cpu", "kv_load_failure_policy": policy})]


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def served_through(request: Callable[[], str], fault: Callable[[], None], after: int,
                   on_timeout: Callable[[], str] = lambda: "") -> tuple[list[str], list[BaseException]]:
    """Send ``request`` in a loop, strike ``fault`` once two answers came, and stop ``after`` answers later:
    (every answer, every failure), each failure being the test's finding."""
    failures: list[BaseException] = []
    answers: list[str] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            try:
                answers.append(request())
            except BaseException as e:  # noqa: BLE001 - every failure is the test's finding
                failures.append(e)
    worker = threading.Thread(target=load)
    worker.start()
    try:
        until(lambda: len(answers) >= 2, "requests flowing before the fault")
        fault()
        n = len(answers)
        until(lambda: len(answers) >= n + after, "requests served after the fault", on_timeout=on_timeout)
    finally:
        stop.set()
        worker.join(timeout=90)
    return answers, failures
