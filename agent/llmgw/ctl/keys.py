"""``llmgw ctl keys``: create, revoke and list a router's API keys in its keys file.

A key is made here so that nobody invents one by hand: 256 random bits from
``secrets``, with a prefix (``sk-llmgw-``) that secret scanners and people
recognise.  It is printed once, on stdout alone (so ``KEY=$(llmgw ctl keys
create ...)`` captures nothing else), and only its SHA-256 is written: the
keys file (``router/keysfile.py``, named by ``router.yaml``'s
``api_keys_file``) can be read, backed up or leaked without granting access.
A lost key is revoked and another created; it cannot be shown again.

Every edit takes a lock beside the file (two operators at once lose neither
change), validates the whole result as the router will (a bad limit is
refused with its JSON pointer before anything is written) and replaces the
file atomically: a router reloading at that moment reads the old file or the
new one, never half of one.  A router puts the change in force on SIGHUP.

``usage`` sums the usage records routers append (``router/usagelog.py``,
``usage_log``) per key and model over a time range; ``--format csv`` is the
export to bill from.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import fcntl
import json
import os
import secrets
import stat
import sys
import time
from dataclasses import asdict, astuple, dataclass, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Iterator

import yaml

from llmgw.config import ConfigInvalid, read_yaml
from llmgw.durable import PRIVATE_MODE, write_atomic
from llmgw.router.auth import hash_key
from llmgw.router.keysfile import keys_file_errors
from llmgw.router.settings import KeyRates

PREFIX = "sk-llmgw-"
RATES = tuple(f.name for f in fields(KeyRates))
HEADER = ("# API keys of llmgw routers (router.yaml's api_keys_file): SHA-256 digests only, never a key.\n"
          "# Edited by `llmgw ctl keys`; `systemctl reload llmgw-router` (SIGHUP) puts a change in force.\n")


class KeysError(Exception):
    """A refused edit; the message is the whole explanation."""


def new_key() -> str:
    """A fresh key: the prefix and 32 random bytes, URL-safe base64."""
    return PREFIX + secrets.token_urlsafe(32)


def entry(name: str, digest: str, models: list[str] | None, limits: dict[str, int | float]) -> dict[str, Any]:
    """One ``api_keys`` item as ``router.yaml`` accepts it."""
    out: dict[str, Any] = {"name": name, "sha256": digest, "models": models if models else "*"}
    if limits:
        out["limits"] = dict(limits)
    return out


def added(doc: dict[str, Any], item: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with ``item`` appended; a name already there is refused, so a key is never replaced silently."""
    keys = list(doc.get("api_keys") or [])
    if any(k.get("name") == item["name"] for k in keys):
        raise KeysError(f"a key named {item['name']!r} exists; revoke it first, or choose another name")
    out = {**doc, "api_keys": keys + [item]}
    errors = keys_file_errors(out)
    if errors:
        raise KeysError("refused, nothing written:\n" + "\n".join(f"  {e}" for e in errors))
    return out


def removed(doc: dict[str, Any], name: str) -> dict[str, Any]:
    keys = list(doc.get("api_keys") or [])
    kept = [k for k in keys if k.get("name") != name]
    if len(kept) == len(keys):
        raise KeysError(f"no key named {name!r}")
    return {**doc, "api_keys": kept}


def summary(item: dict[str, Any]) -> dict[str, Any]:
    """What ``list`` shows of a key: never its digest (it identifies the key in any leaked log or file)."""
    return {"name": item["name"], "models": item.get("models", "*"), "limits": item.get("limits") or {}}


def _read(path: Path) -> dict[str, Any]:
    """The current keys file (empty when there is none yet); one that is invalid is left alone, not repaired."""
    if not path.exists():
        return {"api_keys": []}
    doc = read_yaml(path)
    errors = keys_file_errors(doc)
    if errors:
        raise ConfigInvalid(str(path), errors)
    return dict(doc or {"api_keys": []})


def _write(path: Path, doc: dict[str, Any]) -> None:
    """Replace ``path`` atomically: 0600 when new, else with the mode and owner it had (the router must still read it)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        st = None
    data = (HEADER + yaml.safe_dump(doc, sort_keys=False)).encode()
    write_atomic(path, data, mode=stat.S_IMODE(st.st_mode) if st else PRIVATE_MODE)
    if st is not None and (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
        with contextlib.suppress(PermissionError):
            os.chown(path, st.st_uid, st.st_gid)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Serialise edits of one keys file (a read-modify-write) across processes."""
    fd = os.open(path.parent / f".{path.name}.lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0),
                 PRIVATE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def cmd_create(args: argparse.Namespace) -> int:
    limits = {n: getattr(args, n) for n in (*RATES, "default_max_tokens", "cached_prompt_weight")
              if getattr(args, n) is not None}
    key = new_key()
    path = Path(args.file)
    with _locked(path):
        doc = added(_read(path), entry(args.name, hash_key(key), args.models, limits))
        _write(path, doc)
    print(key)
    print(f"llmgw ctl keys: created {args.name!r} in {path}; the key above is shown only now. "
          "Reload the routers (systemctl reload llmgw-router) to put it in force.", file=sys.stderr)
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    path = Path(args.file)
    with _locked(path):
        if not path.exists():
            raise KeysError(f"{path}: no such keys file")
        _write(path, removed(_read(path), args.name))
    print(f"llmgw ctl keys: revoked {args.name!r} in {path}. Reload the routers (systemctl reload "
          "llmgw-router): until then they still accept it.", file=sys.stderr)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    path = Path(args.file)
    if not path.exists():
        raise KeysError(f"{path}: no such keys file")
    rows = [summary(k) for k in _read(path).get("api_keys") or []]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'NAME':24} {'MODELS':32} LIMITS")
    for r in rows:
        models = r["models"] if isinstance(r["models"], str) else ",".join(r["models"])
        limits = " ".join(f"{k}={v}" for k, v in r["limits"].items() if k != "per_model")
        if r["limits"].get("per_model"):
            limits += f" (+ per model: {', '.join(r['limits']['per_model'])})"
        print(f"{r['name']:24} {models:32} {limits or '-'}")
    return 0


_UNITS = {"m": 60, "h": 3600, "d": 86400}


def parse_time(text: str, now: float) -> float:
    """``--since``/``--until``: an age (``30m``, ``24h``, ``7d``) or an ISO time (UTC unless it says otherwise)."""
    if text[:-1].isdigit() and text[-1:] in _UNITS:
        return now - int(text[:-1]) * _UNITS[text[-1]]
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise KeysError(f"{text!r}: expected an age (30m, 24h, 7d) or an ISO time (2026-12-01T00:00Z)") from None
    return (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).timestamp()


@dataclass
class UsageRow:
    key: str
    model: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # part of prompt_tokens: what the engine had in its prefix cache
    completion_tokens: int = 0
    first_minute: str = ""
    last_minute: str = ""


def sum_usage(lines: Iterable[str], since: float | None, until: float | None) -> tuple[list[UsageRow], int]:
    """Sum the usage record's lines per key and model over minutes starting in [since, until); and how many were unreadable.

    A minute counts whole where it starts: ``--since 10:00`` takes 10:00's minute, not 09:59's.
    """
    rows: dict[tuple[str, str], UsageRow] = {}
    bad = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            minute = rec["minute"]
            start = datetime.fromisoformat(minute.replace("Z", "+00:00")).timestamp()
            counts = [int(rec[f]) for f in ("requests", "prompt_tokens", "completion_tokens")]
            cached = int(rec.get("cached_prompt_tokens", 0))  # absent from lines written before it was recorded
            key, model = str(rec["key"]), str(rec["model"])
        except (ValueError, KeyError, TypeError, AttributeError):
            bad += 1  # a line torn by a full disk, or not ours
            continue
        if (since is not None and start < since) or (until is not None and start >= until):
            continue
        row = rows.setdefault((key, model), UsageRow(key, model, first_minute=minute, last_minute=minute))
        row.requests += counts[0]
        row.prompt_tokens += counts[1]
        row.completion_tokens += counts[2]
        row.cached_prompt_tokens += cached
        row.first_minute = min(row.first_minute, minute)
        row.last_minute = max(row.last_minute, minute)
    return sorted(rows.values(), key=lambda r: (r.key, r.model)), bad


def cmd_usage(args: argparse.Namespace) -> int:
    now = time.time()
    since = parse_time(args.since, now) if args.since else None
    until = parse_time(args.until, now) if args.until else None
    lines: list[str] = []
    for path in args.log:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines += f.readlines()
    rows, bad = sum_usage(lines, since, until)
    if bad:
        print(f"llmgw ctl keys: warning: {bad} unreadable line(s) skipped", file=sys.stderr)
    if args.format == "json":
        print(json.dumps([asdict(r) for r in rows], indent=2))
    elif args.format == "csv":
        out = csv.writer(sys.stdout, lineterminator="\n")
        out.writerow([f.name for f in fields(UsageRow)])
        for r in rows:
            out.writerow(astuple(r))
    else:
        print(f"{'KEY':24} {'MODEL':32} {'REQUESTS':>10} {'PROMPT':>14} {'CACHED':>14} {'COMPLETION':>14}")
        for r in rows:
            print(f"{r.key:24} {r.model:32} {r.requests:>10} {r.prompt_tokens:>14} {r.cached_prompt_tokens:>14} "
                  f"{r.completion_tokens:>14}")
    return 0


def _guarded(fn: Any) -> Any:
    """Expected failures as one clear message and exit status 1, never a traceback."""

    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except (KeysError, ConfigInvalid) as e:
            print(f"llmgw ctl keys: error: {e}", file=sys.stderr)
            return 1
        except OSError as e:
            print(f"llmgw ctl keys: error: {e.filename or ''}: {e.strerror or e}".replace(": : ", ": "),
                  file=sys.stderr)
            return 1
    return run


def _file_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--file", required=True, metavar="KEYS.yaml",
                   help="the keys file (router.yaml's api_keys_file); created 0600 by the first create")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``keys`` and its subcommands; each sets ``func(args) -> int``."""
    keys = subparsers.add_parser("keys", help="create, revoke and list routers' API keys (in a keys file)")
    sub = keys.add_subparsers(dest="keys_command", metavar="COMMAND", required=True)

    p = sub.add_parser("create", help="make a key, print it once, store only its SHA-256")
    p.add_argument("name", metavar="NAME", help="who holds it (access log, metrics, limits)")
    _file_arg(p)
    p.add_argument("--models", nargs="+", metavar="MODEL", default=None,
                   help="the models it may use (default: every model)")
    for n in RATES:
        p.add_argument(f"--{n.replace('_', '-')}", type=int, metavar="N", default=None, dest=n)
    p.add_argument("--default-max-tokens", type=int, metavar="N", default=None, dest="default_max_tokens",
                   help="tokens reserved for a request that sets no max_tokens (with token limits)")
    p.add_argument("--cached-prompt-weight", type=float, metavar="W", default=None, dest="cached_prompt_weight",
                   help="what a prompt token the engine had cached counts in the token limits, 0 to 1 (default 1)")
    p.set_defaults(func=_guarded(cmd_create))

    p = sub.add_parser("revoke", help="remove a key by name")
    p.add_argument("name", metavar="NAME")
    _file_arg(p)
    p.set_defaults(func=_guarded(cmd_revoke))

    p = sub.add_parser("list", help="names, models and limits (never the digests)")
    _file_arg(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_guarded(cmd_list))

    p = sub.add_parser("usage", help="requests and tokens per key and model, from routers' usage records")
    p.add_argument("--log", required=True, action="append", metavar="USAGE.jsonl",
                   help="a router's usage_log; repeat for every router")
    p.add_argument("--since", metavar="WHEN", help="minutes from this time on: 24h, 7d, or 2026-12-01T00:00Z")
    p.add_argument("--until", metavar="WHEN", help="minutes before this time (same forms)")
    p.add_argument("--format", choices=("table", "csv", "json"), default="table",
                   help="csv: one row per key and model, to bill from")
    p.set_defaults(func=_guarded(cmd_usage))
    return keys


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m llmgw.ctl.keys ...``)."""
    parser = argparse.ArgumentParser(prog="llmgw ctl")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
