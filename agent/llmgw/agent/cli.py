"""``llmgw agent --config agent.yaml``."""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "agent",
        help="run the node agent (supervises engines, streams to the control plane)",
        description="Run this node's agent: discover hardware, adopt or clean up engines left by a "
                    "previous agent, then keep a mutual-TLS stream to the control plane.",
    )
    p.add_argument("--config", required=True, metavar="agent.yaml", help="agent configuration file")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from llmgw.agent.main import run_agent
    from llmgw.config import ConfigInvalid
    from llmgw.settings import load_agent_settings

    try:
        settings = load_agent_settings(args.config)
    except ConfigInvalid as e:
        print(e, file=sys.stderr)  # every error, one per line, each with its pointer
        return 2
    return run_agent(settings)
