"""A key's request limit holds across two standalone routers of two workers each (allowance slices).

Real processes: the control plane (``router_allowance.lease_seconds`` 1),
one agent running the engine simulator, two ``llmgw router`` processes with
their own router certificates and two workers each, leasing slices of the
key's allowance over mutual TLS.  The official ``openai`` client is spread
over both routers (the kernel spreads each router's connections over its
workers).  Each worker enforcing the whole limit on its own would admit up
to four times it.  With the control plane killed (``on_outage: refuse``) the
key is refused once the slices held have ended, and served again once a
restarted control plane's books grant.  A key limited to two concurrent
requests runs at most two at once across the four workers (slow streams,
the simulator's token latency), the rest refused with ``Retry-After``.
"""

from __future__ import annotations

import math
import threading
import time

import httpx
import openai
import pytest

from fleet import Fleet, standalone_router, until
from llmgw.protocol import ALLOWANCE_PATH
from llmgw.router.auth import hash_key
from llmgw.tls.context import client_context

pytestmark = pytest.mark.integration

RPM = 6
WINDOW = 5  # seconds: the key's "minute", short so that it passes within the test
LEASE = 1.0
MSG = [{"role": "user", "content": "hello"}]
CONCURRENT = 2
TOKEN_LATENCY = 0.05  # seconds a token: a 16-token stream runs about 0.8 s


def _keys() -> list[dict]:
    return [{"name": "team", "sha256": hash_key("sk-team"),
             "limits": {"requests_per_minute": RPM, "window_seconds": WINDOW}},
            {"name": "warm", "sha256": hash_key("sk-warm"),
             "limits": {"requests_per_minute": 1000, "window_seconds": WINDOW}},
            {"name": "conc", "sha256": hash_key("sk-conc"), "limits": {"concurrent_requests": CONCURRENT}}]


def _burst(ports: list[int], n: int, threads: int = 4) -> tuple[list[tuple[float, float]], list[httpx.Headers]]:
    """``n`` requests of key ``team`` over every port, no retries: (sent, answered) of 200s, the headers of 429s."""
    ok: list[tuple[float, float]] = []
    refused: list[httpx.Headers] = []
    lock = threading.Lock()
    counter = iter(range(n))

    def worker() -> None:
        clients = [openai.OpenAI(base_url=f"http://127.0.0.1:{p}/v1", api_key="sk-team", max_retries=0,
                                 http_client=httpx.Client(timeout=30)) for p in ports]
        for i in counter:
            sent = time.monotonic()
            try:
                clients[i % len(clients)].chat.completions.create(model="tiny", messages=MSG, max_tokens=2)
                with lock:
                    ok.append((sent, time.monotonic()))
            except openai.RateLimitError as e:
                with lock:
                    refused.append(e.response.headers)

    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return ok, refused


def _most_in_one_window(spans: list[tuple[float, float]]) -> int:
    """The most requests that were surely admitted within one window of each other.

    A request was admitted between its sending and its answer, so requests
    whose earliest sending and latest answer are less than a window apart
    were admitted within one window, however slow the host.
    """
    spans = sorted(spans)
    return max((sum(1 for s, e in spans[i:] if e - spans[i][0] < WINDOW) for i in range(len(spans))), default=0)


def _streams_at_once(ports: list[int], n: int) -> tuple[list[tuple[float, float]], list[httpx.Headers]]:
    """``n`` slow streams of key ``conc`` started together over every port: (first, last chunk) of each admitted."""
    ran: list[tuple[float, float]] = []
    refused: list[httpx.Headers] = []
    lock = threading.Lock()
    go = threading.Barrier(n)

    def one(i: int) -> None:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports[i % len(ports)]}/v1", api_key="sk-conc",
                               max_retries=0, http_client=httpx.Client(timeout=30))
        go.wait()
        try:
            stream = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=16, stream=True)
            times = [time.monotonic() for _ in stream]
            with lock:
                ran.append((times[0], times[-1]))
        except openai.RateLimitError as e:
            with lock:
                refused.append(e.response.headers)

    ts = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return ran, refused


def _most_at_once(spans: list[tuple[float, float]]) -> int:
    """The most streams producing at one instant, from when each one's first and last chunk arrived."""
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])  # an end sorts before a start
    most = now = 0
    for _, d in edges:
        now += d
        most = max(most, now)
    return most


def test_a_keys_requests_per_minute_hold_across_two_routers_of_two_workers(tmp_path):
    with Fleet(tmp_path, nodes={"a": 1}, replicas=1,
               profile={"env": {"LLMGW_SIM_TOKEN_LATENCY": str(TOKEN_LATENCY)}}) as f:
        f.config["router_allowance"] = {"lease_seconds": LEASE}
        f.write_config()
        f.start()
        f.wait_ready(1)
        extra = {"workers": 2, "allow_unauthenticated": False, "api_keys": _keys(),
                 "allowance": {"on_outage": "refuse", "timeout": 2}}
        ports = [standalone_router(f, name, extra)[1] for name in ("router-a", "router-b")]

        def serving(port: int, key: str) -> bool:
            try:
                return httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=10,
                                  headers={"Authorization": f"Bearer {key}"},
                                  json={"model": "tiny", "messages": MSG, "max_tokens": 1}).status_code == 200
            except httpx.HTTPError:
                return False
        for port in ports:  # each router's workers know the engine and the books grant (key "warm")
            until(lambda: all(serving(port, "sk-warm") for _ in range(6)), "the router to serve", on_timeout=f.dump)

        start = time.monotonic()
        ok, refused = _burst(ports, 24)
        time.sleep(LEASE + 0.5)  # slices a worker held unspent come back at their lease's end
        ok2, refused2 = _burst(ports, 12)
        elapsed = time.monotonic() - start
        admitted = len(ok) + len(ok2)

        # never more than the limit in a window, across four workers; each would admit RPM on its own
        assert _most_in_one_window(ok + ok2) <= RPM, (ok, ok2)
        if elapsed < WINDOW:  # both bursts within one window: none of the limit was stranded
            assert admitted == RPM, (len(ok), len(ok2), elapsed)
        for h in refused + refused2:  # every refusal says when to come back, as the openai client reads it
            assert int(h["retry-after"]) >= 1 and int(h["retry-after-ms"]) >= 1, dict(h)
            assert int(h["retry-after"]) <= WINDOW + math.ceil(LEASE) + 1, dict(h)
            assert h["x-ratelimit-limit-requests"] == str(RPM)

        # after the window the key is served again, through either router
        patient = [openai.OpenAI(base_url=f"http://127.0.0.1:{p}/v1", api_key="sk-team", max_retries=3,
                                 http_client=httpx.Client(timeout=60)) for p in ports]
        for c in patient:
            out = c.chat.completions.create(model="tiny", messages=MSG, max_tokens=2)
            assert out.choices

        # two concurrent requests across four workers (each would run two on its own: eight); the rest are
        # refused at once with a Retry-After, and the slots come back when the streams end
        ran, busy = _streams_at_once(ports, 8)
        assert 1 <= _most_at_once(ran) <= CONCURRENT and len(ran) + len(busy) == 8, (ran, len(busy))
        assert busy, "every stream admitted"
        for h in busy:
            assert int(h["retry-after"]) >= 1 and int(h["retry-after-ms"]) >= 1, dict(h)
        patient = openai.OpenAI(base_url=f"http://127.0.0.1:{ports[1]}/v1", api_key="sk-conc", max_retries=4,
                                http_client=httpx.Client(timeout=60))
        assert patient.chat.completions.create(model="tiny", messages=MSG, max_tokens=2).choices

        # the control plane away (on_outage: refuse): once the leases held have ended, every request of the
        # key is refused with a Retry-After, none admitted past what the books granted
        f.server.kill()
        time.sleep(LEASE + 0.2)  # the workers' own clocks end their leases
        down_ok, down = _burst(ports, 8)
        assert not down_ok and len(down) == 8
        assert all(int(h["retry-after"]) >= 1 for h in down), [dict(h) for h in down]
        # back: the new books grant after one lease time, and the key is served again
        f.server.start()
        f.wait_healthy()
        until(lambda: serving(ports[0], "sk-team") and serving(ports[1], "sk-team"), "the key served again",
              on_timeout=f.dump)

        # an operator's certificate cannot lease a key's allowance: only a router's may
        with httpx.Client(verify=client_context(f.pki.ca_cert, *f.pki.admin), timeout=10) as admin:
            r = admin.post(f.url + ALLOWANCE_PATH, json={"instance": "x", "asks": []})
        assert r.status_code == 403, r.text
