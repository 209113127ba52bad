"""``llmgw server --config server.yaml``."""

from __future__ import annotations

import argparse
import sys

from llmgw.config import ConfigInvalid


def _run(args: argparse.Namespace) -> int:
    from llmgw.controlplane.server import run_server
    from llmgw.settings import load_server_settings

    try:
        settings = load_server_settings(args.config)
    except ConfigInvalid as e:
        print(e, file=sys.stderr)
        return 2
    return run_server(settings, args.config)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "server", help="run the control plane (and the in-process router)",
        description="Run the control plane: agent stream and admin API on one mutual-TLS port, the router on "
                    "its own. SIGHUP re-reads the config; an invalid file is refused and the running catalog kept.")
    p.add_argument("--config", required=True, metavar="server.yaml", help="control-plane configuration")
    p.set_defaults(func=_run)
    return p
