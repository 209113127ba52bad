"""Keeping a fetch inside its directory, whatever the source says and whatever is on disk.

A path from a manifest or a hub listing is joined onto a staging directory
and then written, checked, and unlinked when it differs; a commit id from a
hub names a directory.  Either, if trusted, lets the source write or delete
anywhere the agent can (``/etc/...``, ``../../``).  And a symlink inside the
directory (a shared ``model_dir``, or anything that wrote there) turns a
safe-looking relative path into one outside.  So every path is checked
against the manifest rules (``llmgw.repository.path_problem``) and its real
location must be inside the directory before anything touches it.
"""

from __future__ import annotations

import os
from pathlib import Path

from llmgw.agent.fetch.download import FetchError
from llmgw.repository import path_problem


def _within(real: str, root_real: str) -> bool:
    return real == root_real or real.startswith(root_real.rstrip(os.sep) + os.sep)


def inside(root: Path, rel: str, *, what: str = "path") -> Path:
    """``root/rel``, once ``rel`` passes the manifest rules and its real location is inside ``root``."""
    problem = path_problem(rel)
    if problem:
        raise FetchError(f"{what} {rel!r} {problem}; nothing outside {root} is touched")
    p = root / rel
    root_real = os.path.realpath(root)
    if not _within(os.path.realpath(p), root_real):
        raise FetchError(f"{what} {rel!r} leads outside {root} (through a symlink: "
                         f"{os.path.realpath(p)}); refusing to write or remove it")
    return p


def check_tree(root: Path) -> None:
    """FetchError naming the first symlink under ``root`` whose target is outside it.

    Directory links are not followed by the walk, so a link to ``/`` costs
    nothing; a link inside the tree is harmless and left alone.
    """
    root_real = os.path.realpath(root)
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            if os.path.islink(p) and not _within(os.path.realpath(p), root_real):
                raise FetchError(f"{p} is a symlink to {os.path.realpath(p)}, outside {root}; "
                                 f"refusing to fetch into or publish a tree that leads elsewhere")
