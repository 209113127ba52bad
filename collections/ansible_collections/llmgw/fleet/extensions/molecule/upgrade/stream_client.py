"""Stream chat completions through the router until told to stop, and count every failure.

Run by the upgrade scenario on the controller while playbooks/upgrade.yml
restarts the fleet's services. A request counts as good only if it streamed
at least one token and ended with a finish_reason: a stream cut short, an
error event, a connection refused or an HTTP error is a failure. Writes a
JSON report when the stop file appears.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import openai


def one(client: openai.OpenAI, model: str) -> str | None:
    """One streamed completion; None when it was good, else what went wrong."""
    tokens, finish = 0, None
    try:
        stream = client.chat.completions.create(
            model=model, stream=True, max_tokens=32,
            messages=[{"role": "user", "content": "Count slowly to ten."}])
        for chunk in stream:
            for choice in chunk.choices:
                if choice.delta and choice.delta.content:
                    tokens += 1
                finish = choice.finish_reason or finish
    except Exception as e:  # noqa: BLE001 - every failure is counted, with its kind
        return f"{type(e).__name__}: {e}"
    if not tokens or finish is None:
        return f"stream ended without tokens or finish_reason (tokens={tokens}, finish={finish})"
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--api-key", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--stop-file", required=True)
    ap.add_argument("--report", required=True)
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args()

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=60)
    lock = threading.Lock()
    counts = {"ok": 0, "failed": 0}
    errors: list[str] = []

    def worker() -> None:
        while not os.path.exists(args.stop_file):
            err = one(client, args.model)
            with lock:
                counts["failed" if err else "ok"] += 1
                if err and len(errors) < 20:
                    errors.append(err)

    started = time.time()
    threads = [threading.Thread(target=worker) for _i in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    report = {**counts, "errors": errors, "started": started, "stopped": time.time()}
    tmp = args.report + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.replace(tmp, args.report)


if __name__ == "__main__":
    main()
