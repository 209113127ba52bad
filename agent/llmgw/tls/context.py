"""SSL contexts for both ends of every llmgw connection.

Both trust the fleet CA and nothing else: no system roots, so a certificate
from any public authority is as foreign as a self-signed one. TLS 1.3 only,
because every endpoint is ours and 1.3 removes the negotiation surface.
The contexts are plain ``ssl.SSLContext`` objects and go straight into
aiohttp (``web.TCPSite(ssl_context=...)``, ``ClientSession(...).get(ssl=...)``).
"""

from __future__ import annotations

import os
import ssl
from typing import Any
from pathlib import Path

PathLike = str | os.PathLike[str]


class TLSConfigError(Exception):
    """A certificate, key or CA file cannot be loaded; the message names the file."""


def _harden(ctx: ssl.SSLContext, ca_file: PathLike) -> None:
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    # Strict RFC 5280 checks (AKI/SKI present, well-formed extensions). Our
    # CA always satisfies them; a certificate that does not was made elsewhere.
    ctx.verify_flags |= ssl.VERIFY_X509_STRICT
    ctx.verify_flags &= ~ssl.VERIFY_X509_PARTIAL_CHAIN
    ctx.options |= ssl.OP_NO_COMPRESSION
    _load_ca(ctx, ca_file)


def _load_ca(ctx: ssl.SSLContext, ca_file: PathLike) -> None:
    path = Path(ca_file)
    if not path.is_file():
        raise TLSConfigError(f"CA file {path} does not exist")
    try:
        ctx.load_verify_locations(cafile=str(path))
    except ssl.SSLError as exc:
        raise TLSConfigError(f"CA file {path}: not a PEM certificate ({exc.reason or exc})") from exc


def _load_pair(ctx: ssl.SSLContext, cert_file: PathLike, key_file: PathLike) -> None:
    for p in (cert_file, key_file):
        if not Path(p).is_file():
            raise TLSConfigError(f"{p} does not exist")
    try:
        ctx.load_cert_chain(certfile=str(cert_file), keyfile=str(key_file))
    except ssl.SSLError as exc:
        raise TLSConfigError(
            f"cannot load certificate {cert_file} with key {key_file}: {exc.reason or exc}"
        ) from exc


def server_context(
    ca_file: PathLike,
    cert_file: PathLike,
    key_file: PathLike,
    *,
    require_client_cert: bool = True,
) -> ssl.SSLContext:
    """A TLS 1.3 server context that verifies client certificates against the fleet CA.

    With ``require_client_cert=False`` a client may connect without a
    certificate (for endpoints that accept an admin token instead), but a
    certificate it does present is still verified and refused if foreign.
    OpenSSL checks the client certificate's extended key usage here: a
    serverAuth-only certificate is refused as a client.

    No session tickets: fleet clients never resume a session, so the two
    tickets TLS 1.3 sends after every handshake were a third of its server
    CPU (a registration storm is ten thousand handshakes), and a resumed
    session would skip the certificate checks a fresh handshake makes.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _harden(ctx, ca_file)
    ctx.num_tickets = 0
    ctx.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_OPTIONAL
    _load_pair(ctx, cert_file, key_file)
    return ctx


def public_server_context(cert_file: PathLike, key_file: PathLike) -> ssl.SSLContext:
    """A server context for the router's client-facing listener: no client certificates.

    Clients of the OpenAI API are not fleet members: they authenticate with
    API keys and verify the router against whatever CA they were given (the
    fleet CA, or the operator's own PKI for an operator-supplied
    certificate).  TLS 1.2 is the floor rather than 1.3 because these
    clients are not ours; compression stays off.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.options |= ssl.OP_NO_COMPRESSION
    ctx.verify_mode = ssl.CERT_NONE
    _load_pair(ctx, cert_file, key_file)
    return ctx


def client_context(
    ca_file: PathLike,
    cert_file: PathLike | None = None,
    key_file: PathLike | None = None,
) -> ssl.SSLContext:
    """A TLS 1.3 client context: server verified against the fleet CA, hostname
    checked against its SANs, and our own certificate presented when given.

    The certificate and key are read once, here; a caller that wants a rotated
    certificate picked up builds a new context.
    """
    if (cert_file is None) != (key_file is None):
        raise TLSConfigError("a client certificate needs both cert_file and key_file")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    _harden(ctx, ca_file)
    ctx.check_hostname = True
    ctx.verify_mode = ssl.CERT_REQUIRED
    if cert_file is not None and key_file is not None:
        _load_pair(ctx, cert_file, key_file)
    return ctx


class PeerRefused(ssl.SSLCertVerificationError):
    """The server's certificate verified against the fleet CA but is not one this client may talk to."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = self.verify_message = reason

    def __str__(self) -> str:
        return self.reason


def _check_peer(conn: ssl.SSLObject | ssl.SSLSocket) -> None:
    check = getattr(conn.context, "llmgw_peer_check", None)
    if check is not None:
        check(conn)


class _CheckedSSLObject(ssl.SSLObject):
    """asyncio's TLS (aiohttp): the peer check runs the moment the handshake completes."""

    def do_handshake(self) -> None:
        super().do_handshake()
        _check_peer(self)


class _CheckedSSLSocket(ssl.SSLSocket):
    """Blocking sockets (httpx in ``llmgw ctl``): the same check, at the same point."""

    def do_handshake(self, block: bool = False) -> None:
        super().do_handshake(block)
        _check_peer(self)


def control_plane_context(
    ca_file: PathLike,
    cert_file: PathLike | None = None,
    key_file: PathLike | None = None,
    *,
    revocations: Any = None,
) -> ssl.SSLContext:
    """``client_context`` for talking to the control plane: the server must hold the fleet CA's
    ``server`` role and must not be on ``revocations`` (a ``Revocations``, read at each handshake).

    The CA and the hostname prove only that the peer holds *some* fleet
    certificate for that name; a router's certificate is serverAuth too and
    carries the addresses clients dial.  The check runs inside the
    handshake call, before the HTTP request, the WebSocket upgrade, a
    bearer token or a ``register`` is written, so a peer that fails it is
    told nothing.
    """
    ctx = client_context(ca_file, cert_file, key_file)
    ctx.sslobject_class = _CheckedSSLObject
    ctx.sslsocket_class = _CheckedSSLSocket

    def check(conn: ssl.SSLObject | ssl.SSLSocket) -> None:
        from .identity import IdentityError, check_server_identity, peer_identity

        try:
            identity = peer_identity(conn)
            check_server_identity(identity)
            if revocations is not None:
                revocations.check(identity)
        except IdentityError as e:
            raise PeerRefused(f"refusing the control plane's certificate: {e.reason}") from None

    ctx.llmgw_peer_check = check  # type: ignore[attr-defined]
    return ctx
