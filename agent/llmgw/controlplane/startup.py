"""What ``llmgw server`` checks before it starts, and the refusal that names what to change."""

from __future__ import annotations

import logging
from pathlib import Path

from llmgw.settings import ServerSettings
from llmgw.tls.revocation import RevocationError, Revocations

log = logging.getLogger("llmgw.controlplane")


class StartupRefused(Exception):
    """The server will not start; the message says why and what to change."""


def tls_context(settings: ServerSettings):
    """The API's SSL context, or None in (explicitly) insecure mode; ``StartupRefused`` otherwise."""
    if settings.tls is None:
        if not settings.insecure_no_tls:
            raise StartupRefused("no tls section in server.yaml: the agent stream and the API require mutual TLS "
                                 "(set insecure_no_tls: true only for development)")
        for line in ("*** insecure_no_tls is set: the API and agent stream run WITHOUT TLS ***",
                     "*** node identities are NOT checked; any client can register as any node ***",
                     "*** development only: never run a fleet like this ***"):
            log.warning(line)
        return None
    if settings.insecure_no_tls:
        log.warning("insecure_no_tls is set but a tls section is present: TLS and identity stay on")
    from llmgw.tls import TLSConfigError, server_context
    from llmgw.tls.files import private_mode_problem

    key = Path(settings.tls.key)
    if key.is_file():
        problem = private_mode_problem(key)
        if problem:
            raise StartupRefused(f"tls.key: {problem}")
    try:
        # Client certificates are optional at the handshake so an operator can
        # use a bearer token; a certificate that is presented is still verified,
        # and the stream refuses any connection without a node certificate.
        return server_context(settings.tls.ca, settings.tls.cert, settings.tls.key, require_client_cert=False)
    except TLSConfigError as e:
        raise StartupRefused(f"tls: {e}") from e


def revocations_for(settings: ServerSettings) -> Revocations:
    """The revocation list ``tls.revoked`` names (empty when none); ``StartupRefused`` when it cannot be read."""
    try:
        return Revocations(settings.tls.revoked if settings.tls is not None else None)
    except RevocationError as e:
        raise StartupRefused(f"tls.revoked: {e}") from e
