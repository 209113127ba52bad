"""Stream chat completions through the routers until told to stop, and count every failure.

Run by the upgrade scenario on the controller while playbooks/upgrade.yml
restarts the fleet's services and the control plane is killed. A request counts
as good only if it streamed at least one token and ended with a finish_reason:
a stream cut short, an error event, an HTTP error or no router taking the
connection is a failure. With several --base-url (one per router) the client
does what a client of redundant routers does: it spreads requests over them and,
when one does not take the request (connection or TLS handshake failed, or closed
before any answer: a restarting router), sends that request to the next; nothing
else is retried, and a request any router took and failed is a failure. Writes a JSON report when the stop file appears,
or after --max-seconds: a converge that fails before it writes the stop file must not leave the client dialling
routers that are gone (it did, at most of a core, until Ansible's async limit ended it half an hour later).
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import threading
import time

import httpx
import openai


# After a request no router took; a restart refuses connections for a second or two, so this costs
# the test nothing, and a client whose fleet is gone waits instead of spinning.
NONE_TOOK_IT_PAUSE = 0.2


def one(clients: list[openai.OpenAI], start: int, model: str) -> tuple[str | None, int]:
    """One streamed completion, failing over between routers only on a refused connection.

    Returns (None when it was good else what went wrong, how many routers refused it first).
    """
    refused = 0
    for i in range(len(clients)):
        client = clients[(start + i) % len(clients)]
        err, connected = _stream(client, model)
        if connected:
            return err, refused
        if i == len(clients) - 1:
            time.sleep(NONE_TOOK_IT_PAUSE)  # every router refused: no busy loop against a fleet that is down
            return err, refused
        refused += 1
    return "no router", refused


def _stream(client: openai.OpenAI, model: str) -> tuple[str | None, bool]:
    """(what went wrong or None, whether the router took the connection)."""
    tokens, finish = 0, None
    try:
        stream = client.chat.completions.create(
            model=model, stream=True, max_tokens=32,
            messages=[{"role": "user", "content": "Count slowly to ten."}])
    except openai.APIConnectionError as e:
        # No response head came back: refused, or a kept-alive connection the router
        # closed (or reset) as it stopped, before it read the request.
        return f"{type(e).__name__}: {e} ({_root(e)})", not _refused(e)
    except Exception as e:  # noqa: BLE001 - every failure is counted, with its kind
        return f"{type(e).__name__}: {e}", True
    try:
        for chunk in stream:
            for choice in chunk.choices:
                if choice.delta and choice.delta.content:
                    tokens += 1
                finish = choice.finish_reason or finish
    except Exception as e:  # noqa: BLE001 - every failure is counted, with its kind
        return f"{type(e).__name__}: {e}", True
    if not tokens or finish is None:
        return f"stream ended without tokens or finish_reason (tokens={tokens}, finish={finish})", True
    return None, True


def _root(exc: BaseException) -> str:
    """The innermost cause, named: openai says only "Connection error." for every kind."""
    while exc.__cause__ or exc.__context__:
        exc = exc.__cause__ or exc.__context__
    return f"{type(exc).__name__}: {exc}"


def _refused(exc: BaseException) -> bool:
    """The router did not take the request, so another router may: the connection or its TLS
    handshake failed (httpx.ConnectError: nothing was sent; a router that is stopping refuses
    connections, and resets those still queued when it closes its socket), or a kept-alive
    connection was closed before any answer (a stopping router closes its idle connections;
    a request it had accepted it would finish). A request written onto such a connection just
    as it closes is answered by the kernel with a reset instead of the close (the router never
    read it), so a reset before the response head counts as not taken too; the caller asks only
    when no response head arrived."""
    while exc is not None:
        if isinstance(exc, (httpx.ConnectError, ConnectionRefusedError, ConnectionResetError,
                            BrokenPipeError)) or (
                isinstance(exc, httpx.RemoteProtocolError) and "without sending a response" in str(exc)) or (
                isinstance(exc, (httpx.ReadError, httpx.WriteError))
                and any(w in str(exc) for w in ("Connection reset", "Broken pipe", "EOF occurred"))):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True, action="append", help="a router's /v1 URL (repeatable)")
    ap.add_argument("--ca", help="CA file the routers' certificates are verified against")
    ap.add_argument("--api-key", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--stop-file", required=True)
    ap.add_argument("--report", required=True)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-seconds", type=float, default=1500.0,
                    help="stop by itself after this long, stop file or not (the converge's async limit is 1800 s)")
    args = ap.parse_args()
    deadline = time.monotonic() + args.max_seconds

    verify = ssl.create_default_context(cafile=args.ca) if args.ca else True
    clients = [openai.OpenAI(base_url=url, api_key=args.api_key, max_retries=0, timeout=60,
                             http_client=httpx.Client(verify=verify, timeout=60))
               for url in args.base_url]
    lock = threading.Lock()
    counts = {"ok": 0, "failed": 0, "failed_over": 0}
    errors: list[str] = []

    def worker(n: int) -> None:
        while not os.path.exists(args.stop_file) and time.monotonic() < deadline:
            err, refused = one(clients, n, args.model)
            n += 1
            with lock:
                counts["failed" if err else "ok"] += 1
                counts["failed_over"] += refused
                if err and len(errors) < 20:  # when, so the log of the run says what was under way
                    errors.append(f"{time.strftime('%H:%M:%S')} after {refused} refusal(s): {err}")

    started = time.time()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    report = {**counts, "errors": errors, "started": started, "stopped": time.time(),
              "deadline_reached": not os.path.exists(args.stop_file)}
    tmp = args.report + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.replace(tmp, args.report)


if __name__ == "__main__":
    main()
