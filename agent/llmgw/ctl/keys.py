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
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import secrets
import stat
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any, Iterator

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


def entry(name: str, digest: str, models: list[str] | None, limits: dict[str, int]) -> dict[str, Any]:
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
    limits = {n: getattr(args, n) for n in (*RATES, "default_max_tokens") if getattr(args, n) is not None}
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


def _guarded(fn: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except KeysError as e:
            print(f"llmgw ctl keys: error: {e}", file=sys.stderr)
            return 1
        except ConfigInvalid as e:
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
    p.set_defaults(func=_guarded(cmd_create))

    p = sub.add_parser("revoke", help="remove a key by name")
    p.add_argument("name", metavar="NAME")
    _file_arg(p)
    p.set_defaults(func=_guarded(cmd_revoke))

    p = sub.add_parser("list", help="names, models and limits (never the digests)")
    _file_arg(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_guarded(cmd_list))
    return keys


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m llmgw.ctl.keys ...``)."""
    parser = argparse.ArgumentParser(prog="llmgw ctl")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
