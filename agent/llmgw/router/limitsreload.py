"""SIGHUP on a standalone router: re-read ``api_keys`` (keys, models and limits) from its config and keys files.

A key revoked or a limit changed must not wait for a restart, which would
drop every stream in flight.  Each worker re-reads and validates the whole
file on its own; a file that fails validation is refused with every error
logged and the keys in force stay.  Only ``api_keys`` (with those of
``api_keys_file``) and ``allow_unauthenticated`` take effect: every other setting is read at
start, and a change to one is logged as waiting for the next restart.
"""

from __future__ import annotations

import logging
from typing import Any

from llmgw.config import ConfigInvalid

from .settings import RouterSettings

log = logging.getLogger("llmgw.router")

# what a reload puts in force; api_keys includes those of api_keys_file (router/keysfile.py), re-read each time
_RELOADED = ("api_keys", "api_keys_file", "allow_unauthenticated")


def reload_keys(proxy: Any, path: str, current: RouterSettings) -> RouterSettings:
    """Re-read ``path`` and put its keys in force in ``proxy``; the settings now in force."""
    from .cli import load

    try:
        new, _ = load(path)
    except (ConfigInvalid, OSError) as e:
        log.error("reload: %s refused, the keys in force stay: %s", path, e)
        return current
    proxy.keys.replace(new.api_keys, new.allow_unauthenticated)
    proxy.limiter.replace(new.api_keys)
    others = [f for f in RouterSettings.__dataclass_fields__
              if f not in _RELOADED and getattr(new, f) != getattr(current, f)]
    if others:
        log.warning("reload: %s changed; it takes effect at the next restart", ", ".join(sorted(others)))
    log.info("reload: %d API key(s) in force, %d with limits", len(new.api_keys), len(proxy.limiter.keys))
    return new


def reloaded_doc(doc: Any, path: str) -> Any:
    """``doc`` with the ``api_keys`` and ``allow_unauthenticated`` of ``path`` when it is valid, else ``doc``."""
    from .cli import load

    try:
        _, new = load(path)
    except (ConfigInvalid, OSError):
        return doc  # each worker logs why
    out = {k: v for k, v in doc.items() if k not in _RELOADED}
    out.update({k: new[k] for k in _RELOADED if k in new})
    return out
