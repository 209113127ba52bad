"""Streaming load through a router from client threads, counting every outcome.

    load = OpenAIStreams(f.router_url, verify=f.router_verify()).start()
    ...
    load.stop()
    assert load.failures == []

``ThreadedLoad`` runs ``_one`` in a loop on each thread until stopped; a
request that raises is a failure, with its message kept.  ``OpenAIStreams``
streams chat completions with the official ``openai`` client and
``max_retries=0`` (the SDK's own retries would hide what the router did); a
stream counts as served only when it carried content and ended with a finish
reason.
"""

from __future__ import annotations

import contextlib
import json
import ssl
import threading
from typing import Any, Iterator

import httpx
import openai

WAIT = 120.0


class ThreadedLoad:
    def __init__(self, threads: int = 2):
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def _client(self) -> contextlib.AbstractContextManager[Any]:
        """One thread's client, closed when the thread ends."""
        raise NotImplementedError

    def _one(self, client: Any) -> None:
        """One request; raise on anything short of a complete answer."""
        raise NotImplementedError

    def _run(self) -> None:
        with self._client() as client:
            while not self._stop.is_set():
                try:
                    self._one(client)
                    with self._lock:
                        self.ok += 1
                except Exception as e:  # every failure is a finding
                    with self._lock:
                        self.failures.append(f"{type(e).__name__}: {e}")

    def start(self) -> "ThreadedLoad":
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(WAIT)

    def count(self) -> int:
        with self._lock:
            return self.ok


class OpenAIStreams(ThreadedLoad):
    def __init__(self, router_url: str, verify: ssl.SSLContext | bool = True, threads: int = 2,
                 model: str = "tiny", max_tokens: int = 8):
        super().__init__(threads)
        self.base_url = f"{router_url}/v1"
        self.verify = verify
        self.model = model
        self.max_tokens = max_tokens

    @contextlib.contextmanager
    def _client(self) -> Iterator[openai.OpenAI]:
        with httpx.Client(verify=self.verify, timeout=60) as http:
            yield openai.OpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=60,
                                http_client=http)

    def _one(self, client: openai.OpenAI) -> None:
        text, finish = [], None
        stream = client.chat.completions.create(model=self.model, messages=[{"role": "user", "content": "count"}],
                                                max_tokens=self.max_tokens, stream=True)
        for chunk in stream:
            for c in chunk.choices:
                if c.delta.content:
                    text.append(c.delta.content)
                finish = c.finish_reason or finish
        if not text or finish is None:
            raise RuntimeError(f"stream ended early: {len(text)} piece(s), finish {finish}")


LOAD_PROFILE = {"env": {"LLMGW_SIM_TOKEN_LATENCY": "0.02"}}


class StreamingLoad(ThreadedLoad):
    """Threads streaming completions through a router until stopped, counting outcomes."""

    def __init__(self, url: str, threads: int = 2):
        super().__init__(threads)
        self.url = url

    def _client(self) -> httpx.Client:
        return httpx.Client(timeout=60)

    def _one(self, client: httpx.Client) -> None:
        body = {"model": "tiny", "prompt": "count", "max_tokens": 8, "stream": True}
        chunks = 0
        with client.stream("POST", f"{self.url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
            done = False
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    if "error" in json.loads(line[6:]):
                        raise RuntimeError(f"in-band error: {line[:300]}")
                    chunks += 1
            if not done or chunks == 0:
                raise RuntimeError(f"stream ended early after {chunks} chunk(s)")
