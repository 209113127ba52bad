"""Streaming load through a router with the official ``openai`` client, counting every outcome.

    load = OpenAIStreams(f.router_url, verify=f.router_verify()).start()
    ...
    load.stop()
    assert load.failures == []

Each thread streams chat completions one after another with ``max_retries=0``
(the SDK's own retries would hide what the router did); a stream counts as
served only when it ended with a finish reason and carried content.
"""

from __future__ import annotations

import ssl
import threading

import httpx
import openai

WAIT = 120.0


class OpenAIStreams:
    def __init__(self, router_url: str, verify: ssl.SSLContext | bool = True, threads: int = 2,
                 model: str = "tiny", max_tokens: int = 8):
        self.base_url = f"{router_url}/v1"
        self.verify = verify
        self.model = model
        self.max_tokens = max_tokens
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

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

    def _run(self) -> None:
        http = httpx.Client(verify=self.verify, timeout=60)
        client = openai.OpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=60,
                               http_client=http)
        try:
            while not self._stop.is_set():
                try:
                    self._one(client)
                    with self._lock:
                        self.ok += 1
                except Exception as e:  # every failure is a finding
                    with self._lock:
                        self.failures.append(f"{type(e).__name__}: {e}")
        finally:
            http.close()

    def start(self) -> "OpenAIStreams":
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
