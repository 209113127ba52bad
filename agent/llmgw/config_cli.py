"""``llmgw config validate``: check a file against its schema and semantic rules, listing every error.

Ansible's ``template`` task calls this through ``validate:`` so a rendered
file that the runtime would refuse never replaces a working one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

from llmgw.config import ConfigError, ConfigInvalid, read_yaml, schema_errors

KINDS = ("server", "agent", "router", "hardware")


def _guess_kind(path: Path, doc: object) -> str | None:
    name = path.name.lower()
    for kind in KINDS:
        if name.startswith(kind):
            return kind
    if isinstance(doc, dict):
        if "node_id" in doc and "control_plane" in doc:
            return "agent"
        if "deployments" in doc or "profiles" in doc:
            return "server"
        if "gpus" in doc:
            return "hardware"
    return None


def validate_file(path: str | Path, kind: str | None = None) -> list[ConfigError]:
    """Every error of ``path`` as ``kind`` (guessed from name/content when None)."""
    path = Path(path)
    try:
        doc = read_yaml(path)
    except ConfigInvalid as e:
        return list(e.errors)
    kind = kind or _guess_kind(path, doc)
    if kind is None:
        return [ConfigError("", f"cannot tell which kind of file this is; pass --kind ({'|'.join(KINDS)})")]
    parse = _parser(kind)
    if parse is not None:
        try:
            parse(doc, str(path))
        except ConfigInvalid as e:
            return list(e.errors)
        return []
    if kind == "hardware":
        from llmgw.hardware.simulated import document_errors

        return document_errors(doc)  # the same checks the agent and ctl explain apply
    return schema_errors(doc, kind)


def _parser(kind: str) -> Callable[[object, str], object] | None:
    """What the runtime loads a ``kind`` file with (schema and its own rules), imported late."""
    if kind == "server":
        from llmgw.settings import parse_server_settings

        return parse_server_settings
    if kind == "agent":
        from llmgw.settings import parse_agent_settings

        return parse_agent_settings
    if kind == "router":
        from llmgw.router.keysfile import validated_with_keys_file
        from llmgw.router.settings import RouterSettings

        return lambda doc, source: RouterSettings.from_config(validated_with_keys_file(doc, source), source)
    return None


def _cmd_validate(args: argparse.Namespace) -> int:
    status = 0
    for f in args.files:
        errors = validate_file(f, args.kind)
        if errors:
            status = 1
            print(f"{f}: {len(errors)} error(s)", file=sys.stderr)
            for e in errors:
                print(f"  {e}", file=sys.stderr)
        elif not args.quiet:
            print(f"{f}: valid")
    return status


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("config", help="validate configuration files")
    sub = p.add_subparsers(dest="config_command", metavar="SUBCOMMAND")
    v = sub.add_parser("validate", help="validate files against their JSON Schema and semantic rules")
    v.add_argument("--kind", choices=KINDS, help="file kind (default: from the file name or content)")
    v.add_argument("-q", "--quiet", action="store_true", help="print nothing for valid files")
    v.add_argument("files", nargs="+", metavar="FILE")
    v.set_defaults(func=_cmd_validate)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
