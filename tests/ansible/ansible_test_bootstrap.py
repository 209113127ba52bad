"""Where ansible-test looks for its cached pip bootstrap script (read by tests/ansible/lint.sh).

ansible-test bootstraps pip in each sanity virtualenv from a get-pip script it
downloads once and caches; lint.sh writes a stand-in there, because the download
is out of reach. Both the pip version and the cache path are ansible-test's
internals (``ansible_test._internal.python_requirements``, the path in
``ansible_test/_util/target/setup/requirements.py``), read in this one place;
tests/ansible/test_ansible_test_bootstrap.py fails, naming them, when an
ansible-core upgrade moves either.

    python tests/ansible/ansible_test_bootstrap.py   -> the cache path to write
"""

from __future__ import annotations

import inspect
import os
import re
from pathlib import Path

CACHE_PATTERN = "~/.ansible/test/cache/get_pip_%s.py"


def pip_version() -> str:
    """The pip version ansible-test bootstraps (``get_venv_packages``'s default)."""
    from ansible_test._internal import python_requirements

    found = re.search(r"pip='([0-9.]+)'", inspect.getsource(python_requirements))
    if found is None:
        raise LookupError("ansible_test._internal.python_requirements names no pip='X.Y' version")
    return found.group(1)


def setup_script() -> Path:
    """ansible-test's target-side requirements script, which reads the cached bootstrap."""
    import ansible_test

    return Path(ansible_test.__file__).parent / "_util" / "target" / "setup" / "requirements.py"


def cache_path(version: str) -> str:
    return os.path.expanduser(CACHE_PATTERN % version.replace(".", "_"))


if __name__ == "__main__":
    print(cache_path(pip_version()))
