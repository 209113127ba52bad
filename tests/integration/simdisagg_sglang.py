"""Driving simulators in SGLang's prefill/decode dialect: starting a side, one request, a pair sent at once."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from llmgw import kvbootstrap
from tests.integration.simproc import HOST, SimProcess, SimStartError, start_sim_argv
from tests.support.ports import free_port

FAKE_BOOTSTRAP_HOST = kvbootstrap.FAKE_HOST  # SGLang's FAKE_BOOTSTRAP_HOST: a transfer with no peer


@dataclass
class Side:
    """A simulator serving one side (or neither: mode null) of an SGLang pair."""

    sim: SimProcess
    bootstrap_port: int

    @property
    def url(self) -> str:
        return self.sim.url

    def bootstrap(self, room: int) -> dict[str, Any]:
        """The fields a router adds to both requests of a pair whose prefill is this side."""
        return {"bootstrap_host": HOST, "bootstrap_port": self.bootstrap_port, "bootstrap_room": room}

    def stop(self) -> None:
        self.sim.stop()


def start_sglang(mode: str, log_dir: Path, env: Mapping[str, str] | None = None,
                 extra: Sequence[str] = ()) -> Side:
    """Start ``llmgw-engine-sim sglang`` in ``--disaggregation-mode mode`` on free ports, retrying a
    port another process took in between."""
    last: SimStartError | None = None
    for _ in range(3):
        port, bootstrap = free_port(), free_port()
        argv = ["sglang", "--model-path", "m", "--host", HOST, "--port", str(port), "--enable-metrics",
                "--disaggregation-mode", mode, "--disaggregation-transfer-backend", "nixl",
                "--disaggregation-bootstrap-port", str(bootstrap), *extra]
        try:
            return Side(start_sim_argv(argv, port, env=env, log_dir=log_dir), bootstrap)
        except SimStartError as e:
            last = e
            if "Address already in use" not in e.output and "address already in use" not in e.output:
                raise
    assert last is not None
    raise last


def post(url: str, body: dict, path: str = "/v1/completions", timeout: float = 60) -> tuple[int, Any]:
    """(status, body): the JSON document, or for a stream the list of its ``data:`` events (JSON decoded
    but for ``[DONE]``)."""
    req = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read().decode()
            status = r.status
            streamed = r.headers.get("Content-Type", "").startswith("text/event-stream")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    if not streamed:
        return status, json.loads(raw)
    events = [line[len("data: "):] for line in raw.split("\n") if line.startswith("data: ")]
    return status, [e if e == "[DONE]" else json.loads(e) for e in events]


def pair(prefill_url: str, decode_url: str, prefill_body: dict, decode_body: dict,
         path: str = "/v1/completions") -> tuple[tuple[int, Any], tuple[int, Any]]:
    """Send a pair's two requests at once, as a router does; (prefill's answer, decoder's answer)."""
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(post, prefill_url, prefill_body, path)
        d = pool.submit(post, decode_url, decode_body, path)
        return p.result(), d.result()


def streamed_text(events: list[Any], chat: bool = False) -> str:
    """The text a stream's chunks carry, in order."""
    out = []
    for e in events:
        if e == "[DONE]" or not e.get("choices"):
            continue
        choice = e["choices"][0]
        out.append((choice.get("delta") or {}).get("content") or "" if chat else choice.get("text") or "")
    return "".join(out)
