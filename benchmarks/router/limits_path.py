#!/usr/bin/env python3
"""Where a limited key's request spends the CPU the key-only one does not: the router's own code, in process.

Each step of the limited path is timed against what the key-only path does in its place,
through the router's real objects (``Proxy``'s ``Limiter`` and ``LimitsGate``, aiohttp's
``Response`` and its header serialiser), on the bodies the engine simulator sends:

* admission: the key's limits looked up and the request reserved (``LimitsGate.reserve``); the
  key-only path looks up a key that has none;
* settlement: ``LimitsGate.finish`` on a whole vLLM answer: the rate-limit headers put on the
  answer, its ``usage`` read, the reservation settled, the usage counted; the key-only path
  skips it;
* the wire: the answer's headers serialised by aiohttp, with the six ``x-ratelimit-*`` or
  without them;
* a stream's admission (``include_usage`` added to the body) and the read that holds the
  stream's usage event (found, decoded and cut from what the client gets).

CPU time (``time.process_time``) of ``--n`` requests a repeat, ``--repeat`` repeats; the
figure is the median µs per request with its range over the repeats. Run by
``limits_cost.py`` for its second table, or alone:

    python benchmarks/router/limits_path.py [--n 20000] [--repeat 7]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import statistics as st
import sys
import time
from typing import Callable

from aiohttp import web
from aiohttp.http_writer import _serialize_headers
from multidict import CIMultiDict

from llmgw.eventloop import run_loop, tune_gc
from llmgw.router.context import RequestContext
from llmgw.router.limitsgate import LimitsGate
from llmgw.router.limits import Limiter
from llmgw.router.metrics import RouterMetrics
from llmgw.router.request import parse_body
from llmgw.router.settings import ApiKey, KeyLimits, KeyRates
from llmgw.router.usage import StreamMeter

KEY = "bench"
PATH = "/v1/chat/completions"
BIG = 10 ** 12
# what the load generator sends and the engine simulator answers (vLLM's serialisation)
BODY = json.dumps({"model": "fast", "stream": False, "max_tokens": 1,
                   "messages": [{"role": "user", "content": "Say something short."}]}).encode()
STREAM_BODY = BODY.replace(b'"stream": false', b'"stream": true')
ANSWER = (b'{"id":"chatcmpl-f5d95258c506ec91","object":"chat.completion","created":1796663480,"model":"fast",'
          b'"choices":[{"index":0,"message":{"role":"assistant","content":"tok0","refusal":null,"annotations":null,'
          b'"audio":null,"function_call":null,"reasoning":null},"logprobs":null,"finish_reason":"length",'
          b'"stop_reason":null,"token_ids":null,"routed_experts":null}],"service_tier":null,'
          b'"system_fingerprint":"vllm-0.32.0-b5c216fd","usage":{"prompt_tokens":4,"total_tokens":5,'
          b'"completion_tokens":1,"prompt_tokens_details":null,"completion_tokens_details":null},'
          b'"prompt_logprobs":null,"prompt_token_ids":null,"prompt_text":null,"kv_transfer_params":null,'
          b'"ec_transfer_params":null,"metrics":null}')
LAST_READ = (b'data: {"id":"chatcmpl-2af6e6b44bf9a568","object":"chat.completion.chunk","created":1796663480,'
             b'"model":"fast","choices":[{"index":0,"delta":{"content":" tok63"},"logprobs":null,'
             b'"finish_reason":"length","stop_reason":null,"token_ids":null}]}\n\n'
             b'data: {"id":"chatcmpl-2af6e6b44bf9a568","object":"chat.completion.chunk","created":1796663480,'
             b'"model":"fast","choices":[],"usage":{"prompt_tokens":4,"total_tokens":68,"completion_tokens":64},'
             b'"system_fingerprint":"vllm-0.32.0-b5c216fd"}\n\ndata: [DONE]\n\n')
STATUS_LINE = "HTTP/1.1 200 OK"


def gates() -> tuple[LimitsGate, LimitsGate]:
    """(key-only, limited): the router's gate over the benchmark's key without and with limits."""
    sha = hashlib.sha256(KEY.encode()).hexdigest()
    rates = KeyRates(requests_per_minute=BIG, input_tokens_per_minute=BIG, output_tokens_per_minute=BIG,
                     tokens_per_minute=BIG, concurrent_requests=BIG, tokens_per_day=BIG)
    plain = Limiter([ApiKey(KEY, sha, None)])
    limited = Limiter([ApiKey(KEY, sha, None, KeyLimits(rates))])
    return LimitsGate(plain, RouterMetrics()), LimitsGate(limited, RouterMetrics())


def answer() -> web.Response:
    """A whole answer as the router builds it from the engine's (``attempts``)."""
    return web.Response(status=200, body=ANSWER, headers={"Content-Type": "application/json",
                                                          "X-Request-Id": "0123456789abcdef"})


def wire_headers(resp: web.Response) -> CIMultiDict:
    """``resp``'s headers as aiohttp sends them (it adds the length, date and server)."""
    h = CIMultiDict(resp.headers)
    h["Content-Length"] = str(len(ANSWER))
    h["Date"] = "Mon, 07 Dec 2026 17:11:20 GMT"
    h["Server"] = "Python/3.11 aiohttp/3.14.5"
    return h


def cpu_us(fn: Callable[[object], None], inputs: object, n: int) -> float:
    """CPU µs per request of ``fn`` handling the ``n`` requests of ``inputs``.

    The collector is tuned as the router tunes it (``eventloop.tune_gc``: what exists is frozen),
    so the inputs made for the run, alive all through it, are not scanned by every collection its
    requests' garbage triggers, as a router's requests, alive a few milliseconds each, are not.
    """
    tune_gc()
    try:
        t0 = time.process_time()
        fn(inputs)
        return (time.process_time() - t0) / n * 1e6
    finally:
        gc.unfreeze()


Step = tuple[str, Callable[[bool], object], Callable[[object], None], Callable[[object], None]]


def steps(n: int) -> list[Step]:
    """(step, inputs of ``n`` requests for the key-only or limited run, key-only run, limited run).

    Inputs are made afresh before each run: a settled ticket settles no second time.
    """
    plain, gate = gates()
    body, sbody = parse_body(BODY), parse_body(STREAM_BODY)
    plain_keys, limited_keys = plain.limiter.keys, gate.limiter.keys
    gate.finish(admitted(gate, 1)[0].limits, dressed := answer(), 200)
    bare, with_limits = wire_headers(answer()), wire_headers(dressed)

    def contexts(_: bool) -> list[RequestContext]:
        return [RequestContext("r", 0.0) for _ in range(n)]

    def admit(keys: dict, parsed, raw: bytes) -> Callable[[list[RequestContext]], None]:
        def run(ctxs: list[RequestContext]) -> None:
            for ctx in ctxs:  # the proxy's test: ``limiter.keys.get(key) if limiter.keys else None``
                st = keys.get(KEY) if keys else None
                if st is not None:
                    gate.reserve(ctx, st, KEY, parsed, raw, PATH)
        return run

    def answers(limited: bool) -> list[tuple[RequestContext, web.Response]]:
        return list(zip(admitted(gate, n) if limited else contexts(False), (answer() for _ in range(n))))

    def settle(pairs: list) -> None:
        for ctx, resp in pairs:  # the proxy's ``if ctx.limits is not None``
            if ctx.limits is not None:
                gate.finish(ctx.limits, resp, 200)

    def wire(headers: CIMultiDict) -> Callable[[object], None]:
        def run(_: object) -> None:
            for _ in range(n):
                _serialize_headers(STATUS_LINE, headers)
        return run

    def meters(limited: bool) -> list[StreamMeter | None]:
        return [StreamMeter(strip=True) if limited else None for _ in range(n)]

    def last_read(meters: list[StreamMeter | None]) -> None:
        for meter in meters:  # a key-only stream's read is relayed as bytes: no meter
            if meter is not None:
                meter.see(LAST_READ)

    return [("admission (limits looked up, request reserved)", contexts, admit(plain_keys, body, BODY),
             admit(limited_keys, body, BODY)),
            ("settlement (headers put on, usage read from the answer, windows settled)", answers, settle, settle),
            ("answer headers serialised (six x-ratelimit-* more)", lambda _: None, wire(bare), wire(with_limits)),
            ("stream admission (include_usage added to the body)", contexts, admit(plain_keys, sbody, STREAM_BODY),
             admit(limited_keys, sbody, STREAM_BODY)),
            ("stream's last read (usage event found, decoded and cut)", meters, last_read,
             last_read)]


def admitted(gate: LimitsGate, n: int) -> list[RequestContext]:
    """``n`` requests of the limited key, reserved and not yet settled."""
    body = parse_body(BODY)
    state = gate.limiter.keys[KEY]
    out = []
    for _ in range(n):
        ctx = RequestContext("r", 0.0)
        gate.reserve(ctx, state, KEY, body, BODY, PATH)
        out.append(ctx)
    return out


STREAM_STEPS = 2  # the last two steps are a stream's, the others a whole answer's


def measure(n: int = 20_000, repeat: int = 7) -> list[dict]:
    """Every step's key-only and limited µs per request over ``repeat`` repeats of ``n`` requests."""
    async def run() -> list[dict]:  # in a loop: admission reads the running loop's clock
        out = []
        for what, inputs, plain, limited in steps(n):
            a, b = [], []
            for _ in range(repeat):
                a.append(cpu_us(plain, inputs(False), n))
                b.append(cpu_us(limited, inputs(True), n))
            out.append({"step": what, "key_us": a, "limits_us": b})
        return out

    return run_loop(run())  # the router's loop: admission and settlement read its clock


def added(rows: list[dict]) -> list[float]:
    """Per repeat, the µs a whole (non-streamed) limited answer adds over the key-only one."""
    whole = rows[:len(rows) - STREAM_STEPS]
    return [sum(r["limits_us"][i] - r["key_us"][i] for r in whole) for i in range(len(whole[0]["key_us"]))]


def table(rows: list[dict], n: int) -> list[str]:
    """The page's second table: each step's median µs per request and its range over the repeats."""
    def cell(xs: list[float]) -> str:
        return f"{st.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"
    lines = ["| step | key only µs/request | limits µs/request | added µs/request |", "|---|---|---|---|"]
    for r in rows:
        diff = [b - a for a, b in zip(r["key_us"], r["limits_us"])]
        lines.append(f"| {r['step']} | {cell(r['key_us'])} | {cell(r['limits_us'])} | {cell(diff)} |")
    lines.append(f"| whole answer: the first three steps together | | | {cell(added(rows))} |")
    lines.append("")
    lines.append(f"{len(rows[0]['key_us'])} repeats of {n:,} requests a step; median (range over the repeats).")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    print("\n".join(table(measure(args.n, args.repeat), args.n)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
