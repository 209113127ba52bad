"""``llmgw ctl nodes | replicas | drain | cordon | uncordon | openapi`` and the online ``ctl explain MODEL``.

A synchronous httpx client to the control-plane API, authenticated with an
admin certificate (``--cert/--key``) or an admin token (``--token``), the
server verified against the fleet CA (``--ca``) and required to hold the
``server`` role, not a router's or anyone else's certificate, before the
token is sent (and not to be on ``--revoked``).  Every flag has an
environment variable (``LLMGW_URL``, ``LLMGW_CA``, ``LLMGW_CERT``,
``LLMGW_KEY``, ``LLMGW_TOKEN``, ``LLMGW_REVOKED``) so scripts and shells set
them once.

Tables are for people; ``-o json`` prints the API's answer unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from llmgw.protocol import Cordon, NodeState, ReplicaState, ShardState

ENV = {"url": "LLMGW_URL", "ca": "LLMGW_CA", "cert": "LLMGW_CERT", "key": "LLMGW_KEY", "token": "LLMGW_TOKEN",
       "revoked": "LLMGW_REVOKED"}


NO_ROUTE = "no route "  # how the API's 404 for a path it does not serve begins (an older server's, for a newer route)


class CtlError(Exception):
    """Printed as ``llmgw ctl: <message>``; exit status 1."""


# ----------------------------------------------------------------- the client

def add_connection_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("control plane")
    g.add_argument("--url", help=f"control-plane API, e.g. https://cp.example:8443 (env {ENV['url']})")
    g.add_argument("--ca", help=f"fleet CA certificate to verify the server (env {ENV['ca']})")
    g.add_argument("--cert", help=f"admin client certificate (env {ENV['cert']})")
    g.add_argument("--key", help=f"admin client key (env {ENV['key']})")
    g.add_argument("--token", help=f"admin bearer token instead of a certificate (env {ENV['token']})")
    g.add_argument("--revoked", help=f"revocation list: refuse a control plane whose certificate is on it "
                                     f"(env {ENV['revoked']})")
    g.add_argument("--timeout", type=float, default=30.0, help="seconds per request (default 30)")


def _opt(args: argparse.Namespace, name: str) -> str | None:
    value = getattr(args, name, None)
    return value if value else os.environ.get(ENV[name]) or None


def make_client(args: argparse.Namespace) -> httpx.Client:
    url = _opt(args, "url")
    if not url:
        raise CtlError(f"no control plane: pass --url or set {ENV['url']}")
    ca, cert, key, token = (_opt(args, n) for n in ("ca", "cert", "key", "token"))
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    verify: Any = True
    if url.startswith("https://"):
        if (cert is None) != (key is None):
            raise CtlError("--cert and --key go together")
        if ca is None:
            raise CtlError(f"--ca (or {ENV['ca']}) is required: the server is verified against the fleet CA only")
        from llmgw.tls import RevocationError, Revocations, TLSConfigError, control_plane_context

        try:
            # only the control plane's own certificate (role server, not revoked) gets the token
            revoked = _opt(args, "revoked")
            verify = control_plane_context(ca, cert, key, revocations=Revocations(revoked) if revoked else None)
        except (TLSConfigError, RevocationError) as e:
            raise CtlError(str(e)) from e
    if cert is None and token is None:
        raise CtlError("no credentials: pass --cert/--key (admin certificate) or --token")
    return httpx.Client(base_url=url.rstrip("/"), verify=verify, headers=headers,
                        timeout=float(getattr(args, "timeout", 30.0)))


class Answer(dict):
    """An API answer: the decoded document, and the bytes it came in (``raw``)."""

    raw: bytes = b""


def request(args: argparse.Namespace, method: str, path: str, passthrough: bool = False,
            missing_ok: bool = False) -> Any:
    """The API's answer to one request, decoded; with ``passthrough``, for ``-o json`` into a pipe, as it came.

    ``missing_ok``: a 404 is None, not an error (the question was whether it exists).
    """
    with make_client(args) as client:
        try:
            resp = client.request(method, path)
        except httpx.HTTPError as e:
            raise CtlError(f"cannot reach {client.base_url}: {type(e).__name__}: {e}") from e
    if passthrough and resp.status_code < 400 and getattr(args, "output", "text") == "json" and not sys.stdout.isatty():
        # Printed as it came: decoding and re-encoding tens of megabytes (a 10,000-node
        # fleet's replicas) costs seconds, and a pipe into jq needs no indentation.
        answer = Answer()
        answer.raw = resp.content
        return answer
    try:
        body = resp.json()
    except ValueError:
        body = None
    if missing_ok and resp.status_code == 404:
        if isinstance(body, dict) and str(body.get("error", "")).startswith(NO_ROUTE):
            raise CtlError(f"{method} {path}: the control plane at {_opt(args, 'url')} has no such route: it is older "
                           f"than this llmgw ctl; upgrade it (playbooks/upgrade.yml) or use the ctl of its version")
        return None
    if resp.status_code >= 400:
        detail = body.get("error") if isinstance(body, dict) else None
        if isinstance(body, dict) and body.get("errors"):
            detail = (detail + "\n" if detail else "") + "\n".join(f"  {e}" for e in body["errors"])
        raise CtlError(f"{method} {path}: HTTP {resp.status_code}: {detail or resp.text[:500]}")
    return body


# ------------------------------------------------------------------ formatting

def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    cells = [[("-" if c is None else str(c)) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*headers).rstrip()] + [fmt.format(*r).rstrip() for r in cells]


def human_bytes(n: float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_age(s: float | None) -> str:
    if s is None:
        return "-"
    s = float(s)
    if s < 90:
        return f"{s:.0f}s"
    if s < 5400:
        return f"{s / 60:.0f}m"
    if s < 172800:
        return f"{s / 3600:.0f}h"
    return f"{s / 86400:.0f}d"


def human_rate(bps: float) -> str:
    """"210 MiB/s", "3.2 GiB/s": a rate needs two or three figures, not four."""
    n = float(bps)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}/s" if n < 10 and unit != "B" else f"{n:.0f} {unit}/s"
        n /= 1024
    return f"{n:.0f} TiB/s"


def human_eta(seconds: float) -> str:
    """"45s", "2m13s", "1h02m"."""
    s = int(seconds + 0.5)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def progress_line(p: dict[str, Any]) -> str:
    """The line under a shard that is downloading its weights.

    ``downloading model.safetensors  12.4 GiB / 40.0 GiB  31%  210 MiB/s  ETA 2m13s``, or, when the
    server sent no length, ``downloading model.gguf  3.1 GiB so far  210 MiB/s``: no invented
    percentage or ETA.  The percentage is rounded down, so 100% only ever means done.  A note
    (a stall being retried) follows in parentheses: that is what tells a hung download from a slow one.
    """
    done, total, rate = p.get("bytes_done") or 0, p.get("bytes_total"), p.get("rate_bps")
    bits = [f"downloading {p.get('file') or p.get('source')}"]
    if total:
        bits += [f"{human_bytes(done)} / {human_bytes(total)}", f"{min(100, int(100 * done / total))}%"]
    else:
        bits.append(f"{human_bytes(done)} so far")
    if rate:
        bits.append(human_rate(rate))
        if total and total > done:
            bits.append(f"ETA {human_eta((total - done) / rate)}")
    line = "  ".join(bits)
    if p.get("note"):
        line += f"  ({p['note']})"
    return line


def tail_lines(tail: str | None, limit: int = 20) -> list[str]:
    if not tail:
        return []
    lines = tail.rstrip("\n").splitlines()
    shown = lines[-limit:]
    head = [f"      | ... ({len(lines) - limit} earlier lines)"] if len(lines) > limit else []
    return head + [f"      | {line}" for line in shown]


def format_nodes(doc: dict[str, Any]) -> list[str]:
    rows = []
    for n in doc.get("nodes", []):
        rows.append([n["node_id"], n["state"] + ("" if n["connected"] else " (disconnected)")
                     + (f", {n['cordon']}" if n.get("cordon") else ""),
                     f"{n['gpus_free']}/{n['gpus_total']}", n.get("address"), n.get("agent_version"),
                     human_age(n.get("last_seen_s")), n.get("epoch")])
    out = table(["NODE", "STATE", "GPUS FREE", "ADDRESS", "AGENT", "LAST SEEN", "EPOCH"], rows)
    for n in doc.get("nodes", []):
        if n["state"] != NodeState.READY and n.get("reason"):
            out.append(f"{n['node_id']}: {n['state']} ({n['reason']})")
        if (n.get("hardware") or {}).get("sick_gpus"):
            out.append(f"{n['node_id']}: {n['hardware']['gpu_reason']}")
        out.extend(cordon_lines(n))
    fleet = doc.get("fleet", {})
    if fleet.get("hold_reason"):
        out.append(f"note: {fleet['hold_reason']}")
    elif fleet.get("startup_grace_left_s"):
        out.append(f"note: control plane started recently; nothing new is placed and no node is declared lost "
                   f"for another {fleet['startup_grace_left_s']:.0f}s")
    if not doc.get("nodes"):
        out.append("(no node has registered)")
    return out


def cordon_lines(n: dict[str, Any]) -> list[str]:
    """What a cordoned or draining node tells the operator, under the table."""
    if n.get("cordon") == Cordon.CORDONED:
        return [f"{n['node_id']}: cordoned: nothing new is placed here (llmgw ctl uncordon {n['node_id']})"]
    if n.get("cordon") != Cordon.DRAINING:
        return []
    if n.get("drained"):
        return [f"{n['node_id']}: drained: no replica left; cordoned until llmgw ctl uncordon {n['node_id']}"]
    line = f"{n['node_id']}: draining: {n.get('replicas_left')} replica(s) still here, moved one at a time"
    if n.get("drain_blocked"):
        line += f"; waiting: {n['drain_blocked']}"
    return [line]


def ejection_lines(ej: dict[str, Any] | None) -> list[str]:
    """Routers reporting a replica ejected, and the control plane's verdict."""
    if not ej:
        return []
    out = [f"    ejected by {len(ej['routers'])} router(s): {ej.get('verdict') or ''}".rstrip(": ")]
    for rep in ej["routers"]:
        counted = rep.get("counted_for_s")
        seen = "" if counted is None else f", counted here for {human_age(counted)}"
        out.append(f"      router {rep['router']}: for {human_age(rep['ejected_for_s'])}{seen} ({rep['reason']}, "
                   f"{rep['consecutive_failures']} failures in a row; reported {human_age(rep['reported_ago_s'])} ago)")
    return out


def format_replicas(doc: dict[str, Any]) -> list[str]:
    rows = []
    for r in doc.get("replicas", []):
        nodes = sorted({s["node_id"] for s in r["shards"] if s.get("node_id")})
        rk = r.get("route_keys") or {}  # none: an engine that publishes no KV events, or not yet
        rows.append([r["replica_id"], f"{r['model']}/{r['profile']}", r["state"], ",".join(nodes) or "-",
                     r.get("endpoint"), r.get("restarts"), human_age(r.get("age_s")), rk.get("keys", "-"),
                     human_age(rk.get("age_s"))])
    # ROUTE KEYS: the prefix-cache blocks the replica's engine holds, as its agent reported them;
    # KV FEED: how long ago that report last changed them (a long one on a busy replica: a stuck feed)
    header = table(["REPLICA", "MODEL/PROFILE", "STATE", "NODES", "ENDPOINT", "RESTARTS", "AGE", "ROUTE KEYS",
                    "KV FEED"], rows)
    out = [header[0]]
    for line, r in zip(header[1:], doc.get("replicas", [])):
        out.append(line)
        if r.get("reason"):
            retry = f" (next attempt in {r['retry_in_s']:.0f}s)" if r.get("retry_in_s") is not None else ""
            out.append(f"    {r['state']}: {r['reason']}{retry}")
        if r.get("replaces"):
            out.append(f"    replacing {r['replaces']}: it stops once this one is Ready")
        if r.get("sick") and r["state"] == ReplicaState.READY:
            out.append(f"    sick: {r['sick']}; its replacement starts first")
        out.extend(ejection_lines(r.get("ejections")))
        rk = r.get("route_keys")
        if rk and (rk.get("resets") or rk.get("dropped")):
            bits = [f"{rk['resets']} reset(s)" if rk.get("resets") else "",
                    f"{rk['dropped']} dropped past the cap" if rk.get("dropped") else ""]
            out.append(f"    route keys: {', '.join(b for b in bits if b)}")
        for s in r["shards"]:
            gpus = ",".join(map(str, s.get("gpus") or [])) or "-"
            bits = [f"  r{s['rank']}", s.get("node_id") or "(not reported)", f"GPUs {gpus}", s["state"]]
            if s.get("pid"):
                bits.append(f"pid {s['pid']}")
            if s.get("port"):
                bits.append(f"port {s['port']}")
            if s.get("engine_version"):
                bits.append(f"engine {s['engine_version']}")
            if s.get("adopted"):
                bits.append("adopted")
            out.append("  " + "  ".join(bits))
            if s.get("reason") and s["state"] != ShardState.READY:
                out.append(f"      reason: {s['reason']}")
            if s.get("progress"):
                out.append(f"      {progress_line(s['progress'])}")
            out.extend(tail_lines(s.get("output_tail")))
        lf = r.get("last_failure")
        if lf and r["state"] != ReplicaState.FAILED and lf.get("replica_id") != r["replica_id"]:
            out.append(f"    last failure ({lf.get('replica_id')}, {human_age(lf.get('ago_s'))} ago): {lf.get('reason')}")
    for u in doc.get("unplaced", []):
        out.append(f"{u['model']}/{u['profile']}#{u['slot']}: not placed: {u['reason']}")
        lf = u.get("last_failure")
        if lf:
            out.append(f"    last failure ({lf.get('replica_id')}): {lf.get('reason')}")
            out.extend(tail_lines(lf.get("output_tail")))
    for s in doc.get("stopping_unrecognised", []):
        out.append(f"stopping unrecognised shard {s['shard_id']} on {s['node_id']}: {s.get('reason')}")
    if not doc.get("replicas") and not doc.get("unplaced"):
        out.append("(no replicas)")
    return out


def format_explain(doc: dict[str, Any]) -> list[str]:
    out = [f"{a['deployment']}: {a['text']}" for a in doc.get("autoscale", [])]
    for item in doc.get("replicas", []):
        out.append(f"{item['replica']}:")
        out.extend(f"  {line}" for line in item["text"].splitlines())
    if not doc.get("replicas"):
        out.append(f"{doc.get('model')}: no deployment declares it")
    for r in doc.get("refused", []):
        out.append(f"claimed by {r['node_id']} and not adopted: {r['shard_id']} ({r['state']}), being stopped: "
                   f"{r['reason']}")
    out.extend(cache_aware_lines(doc))
    return out


def cache_aware_lines(doc: dict[str, Any]) -> list[str]:
    """Cache-aware routing of the model: the route keys its replicas feed (the control plane's
    book), and whether each router asked (``--router``) routes by them.

    Only a router knows whether it turned precise routing off for a model (its tokenizer parity
    check against the engines' ``/tokenize``), so without ``--router`` this says where to look."""
    model = doc.get("model")
    running = [r for r in doc.get("replicas", []) if r.get("running")]
    feeding = [r for r in running if r.get("route_keys")]
    out = []
    if feeding:
        keys = sum(r["route_keys"].get("keys", 0) for r in feeding)
        oldest = max((r["route_keys"].get("age_s") or 0.0) for r in feeding)
        out.append(f"cache-aware routing: {len(feeding)} of {len(running)} running replica(s) feed route keys "
                   f"({keys} held, the oldest feed changed {human_age(oldest)} ago)")
    routers = doc.get("routers")
    if routers is None:
        if feeding:
            out.append(f"  whether a router routes {model} by them is that router's own decision (its tokenizer "
                       f"parity check): llmgw ctl explain {model} --router URL, or the router's GET /healthz")
        return out
    for r in routers:
        out.append(f"router {r['url']}: {router_verdict(model, r)}")
    return out


def router_verdict(model: Any, r: dict[str, Any]) -> str:
    """One router's precise routing of ``model``, from its ``/healthz`` (or why it did not answer)."""
    if r.get("error"):
        return f"no answer ({r['error']})"
    health = r.get("healthz") or {}
    rk = health.get("route_keys")
    if rk is None:
        return "not cache-aware (no route-key index: balancing.cache_aware lists no model)"
    watch = f"its index last heard from the control plane {human_age(rk.get('age_s'))} ago"
    parity = (health.get("tokenizer_parity") or {}).get(model)
    if parity is None:
        return (f"no tokenizer parity check for {model} (routed by the simulator's tokenizer, or not in "
                f"balancing.cache_aware.models); {watch}")
    if parity.get("parity") == "mismatch":
        return (f"precise routing OFF for {model} until the router restarts (prefix affinity): "
                f"{parity.get('reason')}; {watch}")
    if parity.get("parity") == "ok":
        return f"precise routing on for {model} (tokenizer parity ok on {parity.get('replica')}); {watch}"
    return f"precise routing on for {model}, tokenizer parity not checked yet (no replica answered); {watch}"


def router_health(url: str, ca: str | None, timeout: float) -> dict[str, Any]:
    """A router's ``GET /healthz`` for ``ctl explain --router``: no credential is sent (it needs
    none); an https:// router is verified against ``ca`` (the fleet CA) when given."""
    import ssl

    verify: Any = True
    if url.startswith("https://") and ca:
        verify = ssl.create_default_context(cafile=ca)
    try:
        resp = httpx.get(url.rstrip("/") + "/healthz", verify=verify, timeout=timeout)
        resp.raise_for_status()
        doc = resp.json()
    except (httpx.HTTPError, ValueError, OSError, ssl.SSLError) as e:
        return {"url": url, "error": f"{type(e).__name__}: {e}"}
    if not isinstance(doc, dict):
        return {"url": url, "error": "GET /healthz did not answer a JSON object"}
    return {"url": url, "healthz": doc}


# ------------------------------------------------------------------- commands

def _emit(args: argparse.Namespace, doc: Any, fmt: Callable[[Any], list[str]]) -> None:
    if getattr(args, "output", "text") == "json":
        if isinstance(doc, Answer):
            sys.stdout.flush()
            sys.stdout.buffer.write(doc.raw.rstrip(b"\n") + b"\n")
            sys.stdout.flush()
        else:
            json.dump(doc, sys.stdout, indent=2)
            print()
    else:
        print("\n".join(fmt(doc)))


def _guard(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except CtlError as e:
            print(f"llmgw ctl: {e}", file=sys.stderr)
            return 1
    return run


@_guard
def cmd_nodes(args: argparse.Namespace) -> int:
    _emit(args, request(args, "GET", "/v1/nodes", passthrough=True), format_nodes)
    return 0


@_guard
def cmd_replicas(args: argparse.Namespace) -> int:
    _emit(args, request(args, "GET", "/v1/replicas", passthrough=True), format_replicas)
    return 0


@_guard
def cmd_drain(args: argparse.Namespace) -> int:
    """``drain NODE`` moves every replica off the node; ``drain REPLICA`` drains that one replica."""
    from urllib.parse import quote

    target = args.target
    kind = target_kind(args, target)
    if kind == "node":
        doc = request(args, "POST", f"/v1/nodes/{quote(target, safe='')}/drain")
        _emit(args, doc, lambda d: [f"{target}: draining: cordoned, its replicas move elsewhere one at a time, "
                                    f"each replacement Ready before the old one stops (see llmgw ctl nodes)"])
        return 0
    doc = request(args, "POST", f"/v1/replicas/{quote(target, safe='')}/drain")
    _emit(args, doc, lambda d: [f"{target}: draining; a replacement is placed as soon as GPUs allow"])
    return 0


def target_kind(args: argparse.Namespace, target: str) -> str:
    """"node" or "replica": which of the two ``target`` names, read by id (one node, not the fleet's list)."""
    from urllib.parse import quote

    for kind, path in (("node", "/v1/nodes/"), ("replica", "/v1/replicas/")):
        if request(args, "GET", path + quote(target, safe=""), missing_ok=True) is not None:
            return kind
    raise CtlError(f"{target!r} is neither a registered node (llmgw ctl nodes) nor a replica (llmgw ctl replicas)")


def _cordon(action: str) -> Callable[[argparse.Namespace], int]:
    @_guard
    def run(args: argparse.Namespace) -> int:
        from urllib.parse import quote

        doc = request(args, "POST", f"/v1/nodes/{quote(args.node, safe='')}/{action}")
        _emit(args, doc, lambda d: [f"{args.node}: {d['node']['cordon'] or 'schedulable'}"
                                    + (f" (was {d['was']})" if d.get("was") else "")])
        return 0
    return run


def format_openapi(doc: dict[str, Any]) -> list[str]:
    rows = [(method.upper(), path, op.get("summary", "")) for path, ops in doc.get("paths", {}).items()
            for method, op in ops.items()]
    return table(["METHOD", "PATH", "WHAT"], rows)


@_guard
def cmd_openapi(args: argparse.Namespace) -> int:
    """The admin API's own OpenAPI 3.1 document (``-o json``), or its routes as a table."""
    _emit(args, request(args, "GET", "/openapi.json", passthrough=True), format_openapi)
    return 0


@_guard
def explain_online(args: argparse.Namespace) -> int:
    """``ctl explain MODEL`` against the running control plane."""
    if not args.model:
        raise CtlError("explain: give a MODEL (online), or --config and --hardware (offline)")
    from urllib.parse import quote

    doc = request(args, "GET", f"/v1/explain/{quote(args.model, safe='')}")
    routers = getattr(args, "router", None)
    if routers:  # only routers know whether they route the model by its route keys
        doc["routers"] = [router_health(u, _opt(args, "ca"), float(getattr(args, "timeout", 30.0))) for u in routers]
    _emit(args, doc, format_explain)
    return 0 if all(r.get("placed") for r in doc.get("replicas", [])) else 3


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("nodes", help="nodes, their lifecycle state and free GPUs")
    add_connection_args(p)
    p.add_argument("-o", "--output", choices=("text", "json"), default="text")
    p.set_defaults(func=cmd_nodes)

    p = subparsers.add_parser("replicas", help="replicas with their shards, failures and download progress")
    add_connection_args(p)
    p.add_argument("-o", "--output", choices=("text", "json"), default="text")
    p.set_defaults(func=cmd_replicas)

    p = subparsers.add_parser("drain", help="NODE: cordon it and move its replicas elsewhere, make before break; "
                                            "REPLICA: take it out of the router, stop it and replace it")
    p.add_argument("target", metavar="NODE|REPLICA", help="node id (see ctl nodes) or replica id (see ctl replicas)")
    add_connection_args(p)
    p.add_argument("-o", "--output", choices=("text", "json"), default="text")
    p.set_defaults(func=cmd_drain)

    p = subparsers.add_parser("openapi", help="the admin API's routes; -o json: its OpenAPI 3.1 document")
    add_connection_args(p)
    p.add_argument("-o", "--output", choices=("text", "json"), default="text")
    p.set_defaults(func=cmd_openapi)

    for action, text in (("cordon", "place nothing new on a node (what runs there stays)"),
                         ("uncordon", "make a cordoned or drained node schedulable again (stops a drain)")):
        p = subparsers.add_parser(action, help=text)
        p.add_argument("node", metavar="NODE", help="node id (see ctl nodes)")
        add_connection_args(p)
        p.add_argument("-o", "--output", choices=("text", "json"), default="text")
        p.set_defaults(func=_cordon(action))
