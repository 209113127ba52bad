"""Who is on the other end of a verified TLS connection.

The handshake proves the peer holds a key certified by the fleet CA; this
module turns that certificate into a role and a name and decides whether
they entitle the peer to what it claims. It parses the DER form of the peer
certificate with ``cryptography`` because ``getpeercert()``'s dict form is
empty unless the context verified the peer itself, and because only the DER
form carries the extended key usage.

A role needs both halves: ``OU=node`` *and* the clientAuth usage for a node,
``OU=admin`` *and* clientAuth for an operator, ``OU=server`` *and* serverAuth
for the control plane, ``OU=router`` *and* both usages for a standalone
router, ``OU=engine`` *and* serverAuth for a node's engines serving TLS. An
OU alone, or a usage alone, is no role at all.
"""

from __future__ import annotations

import datetime as dt
import ssl
from dataclasses import dataclass
from typing import Union

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

PeerSource = Union[ssl.SSLObject, ssl.SSLSocket, bytes, x509.Certificate]

_USAGE_NAMES = {
    ExtendedKeyUsageOID.SERVER_AUTH: "serverAuth",
    ExtendedKeyUsageOID.CLIENT_AUTH: "clientAuth",
}


class IdentityError(Exception):
    """The peer's certificate does not entitle it to what it claims.

    ``reason`` is a complete sentence meant for the log line that records the
    refused connection.
    """

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class PeerIdentity:
    """The parts of a verified peer certificate that authorisation looks at."""

    role: str | None  # "node", "admin", "server", "router", or None when the certificate carries no role
    name: str  # the subject common name
    serial: int
    not_after: dt.datetime  # timezone-aware UTC
    organizational_unit: str | None = None
    usages: tuple[str, ...] = ()  # extended key usages, e.g. ("clientAuth",)
    fingerprint_sha256: str = ""

    @property
    def serial_hex(self) -> str:
        return format(self.serial, "x")

    def describe(self) -> str:
        """One line for logs: role, name, serial."""
        return f"{self.role or 'no-role'} {self.name!r} (serial {self.serial_hex})"


def _single(cert: x509.Certificate, oid: x509.ObjectIdentifier) -> str | None:
    """The value of a subject attribute that occurs exactly once, else None."""
    values = cert.subject.get_attributes_for_oid(oid)
    if len(values) != 1:
        return None
    v = values[0].value
    return v if isinstance(v, str) else None


def certificate_usages(cert: x509.Certificate) -> tuple[str, ...]:
    """Extended key usages by name (unknown ones by dotted OID); () when absent."""
    try:
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return ()
    return tuple(_USAGE_NAMES.get(oid, oid.dotted_string) for oid in eku)


def certificate_role(cert: x509.Certificate) -> str | None:
    """The role a certificate carries: OU and EKU must agree, or it has none.

    An absent EKU means "any usage" in X.509; here it grants nothing, because
    our CA always writes one and a certificate without it was made elsewhere.
    """
    ou = _single(cert, NameOID.ORGANIZATIONAL_UNIT_NAME)
    usages = certificate_usages(cert)
    if ou in ("node", "admin") and "clientAuth" in usages:
        return ou
    if ou in ("server", "engine") and "serverAuth" in usages:
        return ou
    if ou == "router" and "serverAuth" in usages and "clientAuth" in usages:
        return "router"
    return None


def _peer_der(source: PeerSource) -> x509.Certificate:
    if isinstance(source, x509.Certificate):
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        der = bytes(source)
    elif hasattr(source, "getpeercert"):
        der = source.getpeercert(binary_form=True)
        if not der:
            raise IdentityError("the peer presented no certificate")
    else:
        raise TypeError(f"expected an SSL object, DER bytes or a certificate, got {type(source).__name__}")
    try:
        return x509.load_der_x509_certificate(der)
    except ValueError as exc:
        raise IdentityError(f"the peer certificate cannot be parsed ({exc})") from exc


def peer_identity(source: PeerSource) -> PeerIdentity:
    """Identity of the peer of ``source`` (an ``ssl.SSLObject``/``SSLSocket``
    after a verified handshake, or the certificate itself as DER or parsed).

    This trusts that the handshake verified the chain against the fleet CA;
    it does not re-verify it. A certificate without exactly one CN is refused.
    """
    cert = _peer_der(source)
    cn = _single(cert, NameOID.COMMON_NAME)
    if cn is None:
        count = len(cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME))
        raise IdentityError(f"the peer certificate has {count} common names; exactly one is required")
    return PeerIdentity(
        role=certificate_role(cert),
        name=cn,
        serial=cert.serial_number,
        not_after=cert.not_valid_after_utc,
        organizational_unit=_single(cert, NameOID.ORGANIZATIONAL_UNIT_NAME),
        usages=certificate_usages(cert),
        fingerprint_sha256=cert.fingerprint(hashes.SHA256()).hex(),
    )


_WANTED_USAGES = {"router": "serverAuth and clientAuth", "server": "serverAuth"}


def _role_refusal(identity: PeerIdentity, wanted: str, action: str) -> IdentityError:
    if identity.role is not None:
        return IdentityError(f"certificate role {identity.role!r} cannot {action}")
    usages = ", ".join(identity.usages) or "none"
    return IdentityError(
        f"certificate {identity.name!r} carries no role (OU {identity.organizational_unit!r}, "
        f"extended key usage {usages}); {action} needs OU={wanted} with "
        f"{_WANTED_USAGES.get(wanted, 'clientAuth')}"
    )


def check_node_identity(identity: PeerIdentity, claimed_node_id: str) -> None:
    """Refuse unless the peer is a node whose CN is exactly ``claimed_node_id``.

    Exact string equality: no case folding, no trailing-dot trimming, since
    either would let one node's certificate answer for a differently spelled id.
    """
    if identity.role != "node":
        raise _role_refusal(identity, "node", "register as a node")
    if not isinstance(claimed_node_id, str):
        raise IdentityError(f"claimed node id {claimed_node_id!r} is not a string")
    if identity.name != claimed_node_id:
        raise IdentityError(
            f"certificate CN {identity.name!r} does not match claimed node id {claimed_node_id!r}"
        )


def check_router_identity(identity: PeerIdentity) -> None:
    """Refuse unless the peer holds a router certificate (the only role given engine keys)."""
    if identity.role != "router":
        raise _role_refusal(identity, "router", "read engine keys as a router")


def check_server_identity(identity: PeerIdentity) -> None:
    """Refuse unless the peer holds the control plane's certificate (OU=server with serverAuth).

    Clients of the control plane check this before they send anything: a
    router's certificate is serverAuth too and lists addresses clients dial,
    so the CA and the hostname alone would let a router (or whoever holds
    its key) collect an operator's bearer token or a node's registration.
    """
    if identity.role != "server":
        if identity.role is not None:
            raise IdentityError(f"the peer's certificate {identity.describe()} is not the control plane's "
                                f"(role {identity.role!r}; a control plane holds OU=server)")
        raise _role_refusal(identity, "server", "serve as the control plane")


def check_admin_identity(identity: PeerIdentity) -> None:
    """Refuse unless the peer holds an operator (admin) certificate."""
    if identity.role != "admin":
        raise _role_refusal(identity, "admin", "act as an admin")
