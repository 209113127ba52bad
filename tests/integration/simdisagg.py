"""Talking to a simulator that is one side of a prefill/decode pair: its connector flags, a completion, a metric."""

from __future__ import annotations

import json
import urllib.error
import urllib.request


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
