"""``llmgw router``: the router alone, fed by static endpoints or the control plane."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from llmgw.config import ConfigError, ConfigInvalid, read_yaml

from .keysfile import with_keys_file
from .settings import RouterSettings

DESCRIPTION = (
    "Run the OpenAI-compatible router without the control plane. Endpoints come from "
    "static_endpoints in the config, or from the control plane's watch API (control_plane). "
    "Exits 2 on an invalid config, naming every problem."
)


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--config", required=True, metavar="router.yaml", help="router configuration (YAML)")
    p.add_argument("--workers", type=int, metavar="N",
                   help="worker processes sharing the port with SO_REUSEPORT (overrides 'workers')")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=run)
    return p


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``router`` on an ``argparse`` subparsers object; ``args.func(args)`` runs it."""
    p = subparsers.add_parser("router", help="run the OpenAI-compatible router alone", description=DESCRIPTION)
    return configure_parser(p)


def load(path: str) -> tuple[RouterSettings, Any]:
    doc = read_yaml(path)
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ConfigInvalid(path, [ConfigError("", f"expected a mapping, got {type(doc).__name__}")])
    doc = with_keys_file(doc, path)  # so a reload (SIGHUP) re-reads the keys file too
    return RouterSettings.from_config(doc, source=path), doc


def run(args: argparse.Namespace) -> int:
    from .serve import PortInUse, configure_logging, serve

    configure_logging(args.log_level)
    if args.workers is not None and args.workers < 1:
        print("--workers: must be at least 1", file=sys.stderr)
        return 2
    try:
        settings, doc = load(args.config)
        return serve(settings, doc, args.config, args.workers, args.log_level)
    except ConfigInvalid as e:
        print(str(e), file=sys.stderr)
        return 2
    except PortInUse as e:
        print(f"llmgw router: {e}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    p = configure_parser(argparse.ArgumentParser(prog="python -m llmgw.router", description=DESCRIPTION))
    args = p.parse_args(argv)
    return args.func(args)
