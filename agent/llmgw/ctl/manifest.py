"""``llmgw ctl manifest DIR``: write the llmgw-manifest.json a repository mirror serves.

An operator mirroring a model (a Hugging Face snapshot, a fine-tune) runs
this once in the directory the web server publishes; the agent then fetches
and verifies exactly what it lists.  The digest it prints is what a model's
``sha256`` declares to pin that revision.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from llmgw.durable import write_atomic
from llmgw.repository import MANIFEST_NAME, build_manifest, parse_manifest


def cmd_manifest(args: argparse.Namespace) -> int:
    root = Path(args.directory)
    if not root.is_dir():
        print(f"{root} is not a directory", file=sys.stderr)
        return 2
    doc, skipped = build_manifest(root, args.revision)
    if not doc["files"]:
        print(f"{root} holds no file to list", file=sys.stderr)
        return 1
    data = (json.dumps(doc, indent=1) + "\n").encode()
    parse_manifest(data, str(root / MANIFEST_NAME))  # what the agent will accept, or the reason now
    for s in skipped:
        print(f"skipped {s} (hidden: engines do not read it, and the fetcher reserves such names)", file=sys.stderr)
    if args.stdout:
        sys.stdout.write(data.decode())
    else:
        write_atomic(root / MANIFEST_NAME, data, mode=0o644)
        total = sum(f["size"] for f in doc["files"])
        print(f"wrote {root / MANIFEST_NAME}: {len(doc['files'])} files, {total} bytes; "
              f"sha256 {hashlib.sha256(data).hexdigest()} (a model's sha256 pins this revision)")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("manifest", help="write llmgw-manifest.json for a model repository mirror")
    p.add_argument("directory", help="the directory the mirror serves (a model repository)")
    p.add_argument("--revision", help="free text recorded in the manifest (a hub commit, a tag)")
    p.add_argument("--stdout", action="store_true", help="print the manifest instead of writing it")
    p.set_defaults(func=cmd_manifest)
    return p
