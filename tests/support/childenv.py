"""What the harnesses' child processes inherit: a ``PYTHONPATH`` that means the same in their directories.

The harnesses start their processes in work directories of their own. ``PYTHONPATH=agent``
(the README's form) names a folder that is not there, so the child silently imports the
package installed in the virtualenv instead; a virtualenv shared by two checkouts then runs
the other checkout's control plane, agent, router and engine simulator, and a test or a
benchmark measures code it was not given.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def absolute_path_list(paths: str) -> str:
    """``paths`` (``os.pathsep``-separated) with each relative entry made absolute against this process's cwd."""
    return os.pathsep.join(os.path.abspath(x) if x else x for x in paths.split(os.pathsep))


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment with ``extra`` on top, its ``PYTHONPATH`` made absolute: what a child
    started in another directory needs to import the same tree."""
    env = {**os.environ, **(extra or {})}
    if env.get("PYTHONPATH"):
        env["PYTHONPATH"] = absolute_path_list(env["PYTHONPATH"])
    return env
