"""Reloading ``server.yaml`` (SIGHUP, ``POST /v1/reload``): a file that fails validation changes nothing.

The revocation list is re-read on every reload, valid file or not:
revoking a key must not wait on an unrelated typo in the catalog.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from llmgw.config import ConfigInvalid
from llmgw.controlplane.revocation import close_revoked_streams
from llmgw.controlplane.state import ControlPlane
from llmgw.settings import load_server_settings
from llmgw.tls.revocation import Revocations

log = logging.getLogger("llmgw.controlplane")


def reload_revocations(cp: ControlPlane, revocations: Revocations, path: str | None) -> None:
    """Re-read the revocation list (``path``: ``tls.revoked`` of the reloaded file) and close revoked streams.

    Runs whether or not the rest of ``server.yaml`` reloads: revoking a key
    must not wait on an unrelated typo in the catalog.
    """
    if path != revocations.path:
        if path is None:
            log.warning("reload: tls.revoked removed; the list %s stays in force until the next restart",
                        revocations.path)
        else:
            log.info("reload: tls.revoked is now %s (was %s)", path, revocations.path)
            revocations.path = path
    revocations.reload()
    close_revoked_streams(cp, revocations)


def reloader(cp: ControlPlane, path: str | None,
             revocations: Revocations | None = None) -> Callable[[], tuple[bool, list[str]]]:
    def reload() -> tuple[bool, list[str]]:
        if path is None:
            return False, ["started without a config file: nothing to reload"]
        try:
            new = load_server_settings(path)
        except ConfigInvalid as e:
            errors = [str(x) for x in e.errors]
            log.error("reload refused, the running catalog stays in force:\n%s", e)
            if revocations is not None:
                reload_revocations(cp, revocations, revocations.path)
            return False, errors
        if revocations is not None:
            reload_revocations(cp, revocations, new.tls.revoked if new.tls is not None else None)
        cp.apply_settings(new, path)
        return True, []
    return reload
