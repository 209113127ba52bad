"""Closed-loop HTTP load generator for OpenAI chat completions (its own process).

``concurrency`` workers each send one request at a time until ``duration``
seconds have passed or ``max_requests`` were sent, whichever comes first.
Loopback targets only.  Prints one JSON object with counts, rates and
latency percentiles.

TTFT is measured to the first chunk that carries generated content, not to
the role-only chunk engines send first, so proxies that hold that chunk back
and those that do not are compared on the same event.

``--warmup S``: the workers run for S seconds before anything is counted, so
every client connection and every connection a proxy opens to its upstream
exists before the measured window (otherwise the first wave of a 256-stream
load measures TCP handshakes and listen-backlog overflow, whose 1 s SYN
retransmit then dominates p99).  When the window opens the generator prints
``warm`` on its own line, so a caller can start its CPU accounting at the same
moment; counts and rates cover the window, latencies and TTFT the requests
sent inside it.

``--stagger S``: worker i sends its first request i*S/concurrency seconds
after the start instead of all at once.  Without it a closed loop of equal
requests stays in lockstep: all 256 streams start, finish and restart
together, every proxy meets a burst of 256 new requests at once, and TTFT p99
measures how long the last of the burst waits behind the others (in the
proxy, the engine and this generator alike) rather than what one request pays
for the hop.  Staggering over one request's length spreads arrivals evenly, as
independent clients do; it belongs inside the warm-up.

``--rate R``: requests are sent on a fixed schedule of R a second (the k-th
at start + k/R, by whichever worker is free; one late is sent at once), not
as fast as the workers' answers return.  A proxy's CPU per request depends on
how many requests each wake of its event loop finds: in a closed loop that
follows the speed of the engine and of this generator, which drift on a
shared host; at a set rate two targets compared see the same arrivals.

``--check-tokens`` (streams against the engine simulator): every answer is
read whole and checked against what the simulator generates (``tok0 tok1
...``, exactly ``--max-tokens`` of them): a stream that ends with an in-band
error after a correct prefix is counted in ``cut_midstream`` (a failure the
client is told about); one with a token missing, duplicated or reordered, or
without ``[DONE]``, in ``integrity_errors`` (a wrong answer that looks right).
``--stop-file F`` ends the run once F exists (for a caller whose load lasts
as long as something else does); ``--events F`` appends one JSON line per
failed request (``t`` in epoch seconds, ``kind``, ``detail``) so a caller can
tell which failures happened when.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
import time
from urllib.parse import urlsplit

import re

import aiohttp

# a content delta with at least one character (not the role chunk's empty content);
# matched loosely because proxies that re-serialise chunks order keys differently
CONTENT = re.compile(rb'"content": ?"[^"]')


def check_stream(body: bytes, n_tokens: int) -> tuple[str, str] | None:
    """None when ``body`` is a whole, correct simulator stream of ``n_tokens``; else (kind, detail).

    kind is ``cut_midstream`` (an in-band error event after a correct prefix: the
    client was told) or ``integrity`` (anything else that is not the exact answer).
    """
    text, done, error = [], False, None
    for event in body.split(b"\n\n"):
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                continue
            if done:
                return "integrity", "data after [DONE]"
            try:
                doc = json.loads(data)
            except ValueError:
                return "integrity", f"undecodable event {data[:120]!r}"
            if "error" in doc:
                error = doc["error"]
                continue
            for choice in doc.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
                if piece:
                    text.append(piece)
    got = "".join(text)
    want = "".join(f"tok{i}" if i == 0 else f" tok{i}" for i in range(n_tokens))
    if error is not None:
        if want.startswith(got) and done:
            return "cut_midstream", f"{len(got.split())} token(s) then error {str(error)[:160]}"
        return "integrity", f"error event after a wrong prefix {got[-80:]!r}: {str(error)[:120]}"
    if not done:
        return "integrity", f"no [DONE] after {len(got.split())} token(s)"
    if got != want:
        return "integrity", f"expected tok0..tok{n_tokens - 1}, got {got[:80]!r}...{got[-80:]!r}"
    return None


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))
    return s[k]


def bodies(args: argparse.Namespace):
    """Request bodies, as bytes, cycled through by the workers."""
    if args.prefix_prompts:
        systems = [" ".join(f"s{p}w{k}" for k in range(args.prefix_words)) for p in range(args.prefix_prompts)]
        i = 0
        while True:
            sys_prompt = systems[i % len(systems)]
            body = {"model": args.model, "stream": args.stream, "max_tokens": args.max_tokens,
                    "messages": [{"role": "system", "content": sys_prompt},
                                 {"role": "user", "content": f"question number {i} about item {i * 7919 % 10007}"}]}
            yield json.dumps(body).encode()
            i += 1
    body = json.dumps({"model": args.model, "stream": args.stream, "max_tokens": args.max_tokens,
                       "messages": [{"role": "user", "content": "Say something short."}]}).encode()
    while True:
        yield body


async def main(args: argparse.Namespace) -> dict:
    host = urlsplit(args.url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"refusing non-loopback target {args.url}")
    url = args.url.rstrip("/") + "/v1/chat/completions"
    connector = aiohttp.TCPConnector(limit=args.concurrency, limit_per_host=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    gen = bodies(args)
    lat: list[float] = []
    ttft: list[float] = []
    errors: dict[str, int] = {}
    counts = {"requests": 0, "ok": 0, "chunks": 0, "tokens": 0, "bytes": 0, "integrity_errors": 0,
              "cut_midstream": 0}
    events = open(args.events, "a") if args.events else None

    def failed(kind: str, detail: str = "") -> None:
        errors[kind] = errors.get(kind, 0) + 1
        if events is not None:
            events.write(json.dumps({"t": time.time(), "kind": kind, "detail": detail}) + "\n")
            events.flush()

    def stopped() -> bool:
        return args.stop_file is not None and os.path.exists(args.stop_file)
    sent = 0
    loop = asyncio.get_running_loop()

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as s:
        # warm the pool so connection set-up is not measured
        auth = {"Authorization": f"Bearer {args.api_key}"}
        await asyncio.gather(*(s.get(args.url.rstrip("/") + args.warm_path, headers=auth)
                               for _ in range(min(args.concurrency, 8))), return_exceptions=True)
        start = time.perf_counter()
        measured_from = start + args.warmup
        deadline = measured_from + args.duration

        def open_window() -> None:
            # everything counted so far belongs to the warm-up
            for k in counts:
                counts[k] = 0
            errors.clear()
            print("warm", flush=True)

        if args.warmup > 0:
            loop.call_later(args.warmup, open_window)
        else:
            open_window()

        async def worker(i: int) -> None:
            nonlocal sent
            if args.stagger > 0:
                await asyncio.sleep(i * args.stagger / args.concurrency)
            while time.perf_counter() < deadline and sent < args.max_requests and not stopped():
                sent += 1
                if args.rate > 0:
                    await _until(start + sent / args.rate)
                body = next(gen)
                t0 = time.perf_counter()
                first = None
                try:
                    async with s.post(url, data=body, headers={"Content-Type": "application/json",
                                                               **auth}) as r:
                        verdict = None
                        if args.stream:
                            tail = b""
                            whole = [] if args.check_tokens else None
                            async for data in r.content.iter_any():
                                counts["bytes"] += len(data)
                                n = len(CONTENT.findall(data))
                                if first is None and n:
                                    first = time.perf_counter()
                                counts["chunks"] += data.count(b"\n\n")
                                counts["tokens"] += n
                                tail = (tail + data)[-32:]
                                if whole is not None:
                                    whole.append(data)
                            ok = r.status == 200 and tail.rstrip().endswith(b"data: [DONE]") \
                                and b'"error"' not in tail
                            if whole is not None and r.status == 200:
                                verdict = check_stream(b"".join(whole), args.max_tokens)
                                ok = verdict is None
                        else:
                            data = await r.read()
                            counts["bytes"] += len(data)
                            ok = r.status == 200
                            first = time.perf_counter()
                    counts["requests"] += 1
                    if ok:
                        counts["ok"] += 1
                        if t0 >= measured_from:
                            lat.append(time.perf_counter() - t0)
                            if first is not None:
                                ttft.append(first - t0)
                    elif verdict is not None:
                        counts["integrity_errors" if verdict[0] == "integrity" else "cut_midstream"] += 1
                        failed(verdict[0], verdict[1])
                    else:
                        failed(f"status_{r.status}")
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                    counts["requests"] += 1
                    failed(type(e).__name__, str(e)[:200])

        await asyncio.gather(*(worker(i) for i in range(args.concurrency)))
        elapsed = time.perf_counter() - max(start, measured_from)
    if events is not None:
        events.close()
    return {
        "elapsed_s": elapsed,
        "warmup_s": args.warmup,
        **counts,
        "errors": errors,
        "rps": counts["ok"] / elapsed,
        "tokens_per_s": counts["tokens"] / elapsed,
        "chunks_per_s": counts["chunks"] / elapsed,
        "latency_p50_ms": _ms(percentile(lat, 0.5)),
        "latency_p99_ms": _ms(percentile(lat, 0.99)),
        "ttft_p50_ms": _ms(percentile(ttft, 0.5)),
        "ttft_p99_ms": _ms(percentile(ttft, 0.99)),
        "loop": type(loop).__module__,
    }


async def _until(when: float) -> None:
    """Sleep until ``when`` (perf_counter seconds); return at once when it has passed."""
    delay = when - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1000


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--duration", type=float, default=8.0, help="measured seconds (after --warmup)")
    p.add_argument("--warmup", type=float, default=0.0, help="unmeasured seconds of the same load first")
    p.add_argument("--stagger", type=float, default=0.0,
                   help="spread the workers' first requests evenly over S seconds (keep S <= --warmup)")
    p.add_argument("--max-requests", type=int, default=1_000_000)
    p.add_argument("--rate", type=float, default=0.0,
                   help="send R requests a second on a fixed schedule (0: closed loop, as fast as answers return)")
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument("--prefix-prompts", type=int, default=0, help="cycle through N shared system prompts")
    p.add_argument("--prefix-words", type=int, default=200)
    p.add_argument("--warm-path", default="/v1/models")
    p.add_argument("--api-key", default="bench")
    p.add_argument("--check-tokens", action="store_true",
                   help="check every streamed answer token by token against the engine simulator's output")
    p.add_argument("--stop-file", help="end the run once this file exists")
    p.add_argument("--events", help="append one JSON line per failed request to this file")
    return p.parse_args(argv)


if __name__ == "__main__":
    ns = parse(sys.argv[1:])
    # The instrument must not add latency of its own: with 256 streams in flight a collection of
    # the older generations stops this process for tens of milliseconds, and every TTFT measured
    # across the pause (whichever target) grows by it. A run lasts seconds; cycles wait for exit.
    gc.disable()
    try:
        import uvloop
        result = uvloop.run(main(ns))
    except ImportError:
        result = asyncio.run(main(ns))
    print(json.dumps(result))
