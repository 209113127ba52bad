"""The ``llmgw`` command line.

Each subsystem registers its own subcommand through an ``add_parser``
function, so this file only knows which exist.  A subsystem whose module is
not part of the build is left out of the command line; any other failure to
import one (a dependency missing or broken) stops every command with its
traceback, because a broken install must not pass for a smaller one.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys

# (module, what it registers); each module has add_parser(subparsers)
_TOP = [
    ("llmgw.config_cli", "config"),
    ("llmgw.controlplane.cli", "server"),
    ("llmgw.agent.cli", "agent"),
    ("llmgw.router.cli", "router"),
]
_CTL = [
    ("llmgw.ctl.explain", "explain"),
    ("llmgw.ctl.cert", "cert"),
    ("llmgw.ctl.fleet", "nodes, replicas, drain, cordon, uncordon, openapi"),
    ("llmgw.ctl.manifest", "manifest"),
    ("llmgw.ctl.keys", "keys"),
]


def _register(subparsers: argparse._SubParsersAction, modules: list[tuple[str, str]]) -> None:
    for modname, what in modules:
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as e:
            if e.name and (modname == e.name or modname.startswith(e.name + ".")):
                continue  # subsystem not part of this build
            raise
        mod.add_parser(subparsers)


def build_parser() -> argparse.ArgumentParser:
    from llmgw import __version__

    parser = argparse.ArgumentParser(prog="llmgw", description="LLM inference fleet: control plane, router, agent.")
    parser.add_argument("--version", action="version", version=f"llmgw {__version__}")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR (default INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _register(sub, _TOP)
    ctl = sub.add_parser("ctl", help="operator commands (llmgw ctl --help lists them)")
    ctl_sub = ctl.add_subparsers(dest="ctl_command", metavar="SUBCOMMAND")
    _register(ctl_sub, _CTL)
    ctl.set_defaults(func=lambda args: (ctl.print_help(), 2)[1])
    return parser


# The long-running subcommands: a service manager may send them SIGHUP (``systemctl reload``).
_DAEMONS = frozenset({"server", "agent", "router"})


def ignore_hangup_until_handled(argv: list[str]) -> bool:
    """A daemon ignores SIGHUP until it installs its own handler (its reload); True if it is one.

    Importing the subsystems takes a second or so; a ``systemctl reload`` right after a restart
    would otherwise meet SIGHUP's default action and end the process. ``ctl`` and ``config`` keep it.
    """
    command = next((a for a in argv if a in _DAEMONS or a in ("ctl", "config")), None)
    if command in _DAEMONS:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        return True
    return False


def main(argv: list[str] | None = None) -> int:
    ignore_hangup_until_handled(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if logging.getLogger().level > logging.DEBUG:
        # httpx logs every request at INFO: noise on ctl's tables, not news.
        logging.getLogger("httpx").setLevel(logging.WARNING)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return int(func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
