"""Issuing leaf certificates for the four roles of the fleet.

- ``server``: the control plane. EKU serverAuth only. Hostname verification
  reads subject alternative names and ignores the common name, so the SANs
  must hold every DNS name and every IP address agents dial; a server
  certificate without SANs is refused outright.
- ``node``: one per GPU node. EKU clientAuth only. CN is the node id, which
  the control plane compares to the id the agent registers as.
- ``admin``: an operator. EKU clientAuth, OU=admin, CN is the operator's name.
- ``router``: a standalone router. EKU serverAuth (it serves clients over
  HTTPS, so SANs as for ``server``) and clientAuth (it reads the control
  plane's endpoint watch, the one caller given the engines' keys). A role of
  its own so that neither a node nor an operator certificate can obtain
  engine keys, and a router certificate can do nothing else.
- ``engine``: the engines of one GPU node serving TLS. EKU serverAuth only, SANs
  the node's fleet address. Its key is read by engine processes (vLLM takes a
  key file), which run third-party model code, so it is a role of its own: it
  opens no stream, reads no watch and cannot pose as the control plane or a
  router (wrong OU), unlike the node certificate the agent keeps to itself.

Subjects are always ``O=llmgw, OU=<role>, CN=<name>``; the role is read back
from OU together with the EKU (see ``identity.py``).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, ExtensionOID, NameOID

from .ca import (
    DEFAULT_KEY_TYPE,
    ORGANIZATION,
    CertificateAuthority,
    PrivateKey,
    generate_key,
    key_to_pem,
    utcnow,
)

ROLES = ("server", "node", "admin", "router", "engine")
DEFAULT_DAYS = {"server": 90, "node": 90, "admin": 30, "router": 90, "engine": 90}
# Roles whose certificates name hosts (SANs) rather than a node or a person.
HOST_ROLES = ("server", "router", "engine")
CLOCK_SKEW = dt.timedelta(minutes=5)
NODE_URI_PREFIX = "urn:llmgw:node:"

ROLE_EKU: dict[str, tuple[x509.ObjectIdentifier, ...]] = {
    "server": (ExtendedKeyUsageOID.SERVER_AUTH,),
    "node": (ExtendedKeyUsageOID.CLIENT_AUTH,),
    "admin": (ExtendedKeyUsageOID.CLIENT_AUTH,),
    "router": (ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH),
    "engine": (ExtendedKeyUsageOID.SERVER_AUTH,),
}

# A node id is a lowercase DNS name: dot-separated labels of [a-z0-9_-], each
# starting and ending with a letter or digit, at most 63 characters per label
# and 253 in all. Lowercase only, because the control plane compares ids as
# exact strings and "Gpu-A1" vs "gpu-a1" must never be two spellings of one node.
# NODE_ID_PATTERN is ECMA-262 compatible so JSON Schemas can use it verbatim
# (together with "maxLength": NODE_ID_MAX_LENGTH) and agree with issuing.
NODE_ID_PATTERN = r"^[a-z0-9](?:[a-z0-9_-]{0,61}[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9_-]{0,61}[a-z0-9])?)*$"
NODE_ID_MAX_LENGTH = 253
NODE_ID_RE = re.compile(NODE_ID_PATTERN)

_DNS_LABEL_RE = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
_ADMIN_NAME_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._@-]{0,62}[A-Za-z0-9])?")


class IssueError(ValueError):
    """A certificate was not issued; the message names the offending input."""


@dataclass(frozen=True)
class LeafRequest:
    """Everything that goes into one leaf certificate, already validated."""

    role: str
    name: str
    dns_names: tuple[str, ...] = ()
    ips: tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, ...] = ()
    uris: tuple[str, ...] = ()

    def subject(self) -> x509.Name:
        return x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
                x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, self.role),
                x509.NameAttribute(NameOID.COMMON_NAME, self.name),
            ]
        )

    def general_names(self) -> list[x509.GeneralName]:
        names: list[x509.GeneralName] = [x509.DNSName(n) for n in self.dns_names]
        names += [x509.IPAddress(ip) for ip in self.ips]
        names += [x509.UniformResourceIdentifier(u) for u in self.uris]
        return names


# ---------------------------------------------------------------- validation


def validate_node_id(node_id: str) -> str:
    """Return ``node_id`` unchanged if it is a valid node id, else IssueError saying why."""
    if not isinstance(node_id, str) or not node_id:
        raise IssueError("node id must be a non-empty string")
    if len(node_id) <= NODE_ID_MAX_LENGTH and NODE_ID_RE.fullmatch(node_id):
        return node_id
    if node_id != node_id.lower():
        hint = f"node ids are lowercase (did you mean {node_id.lower()!r}?)"
    elif node_id.endswith("."):
        hint = "it ends with a dot; write it without the trailing dot"
    elif len(node_id) > 253:
        hint = f"it is {len(node_id)} characters long, the limit is 253"
    elif any(len(label) > 63 for label in node_id.split(".")):
        hint = "a dot-separated label is longer than 63 characters"
    else:
        hint = (
            "use lowercase letters, digits, '-' and '_' in dot-separated labels, "
            "each starting and ending with a letter or digit"
        )
    raise IssueError(f"invalid node id {node_id!r}: {hint}")


def validate_admin_name(name: str) -> str:
    if not isinstance(name, str) or not _ADMIN_NAME_RE.fullmatch(name):
        raise IssueError(
            f"invalid admin name {name!r}: use 1-64 letters, digits, '.', '_', '-', '@', "
            "starting and ending with a letter or digit"
        )
    return name


def validate_dns_name(host: str) -> str:
    """A DNS SAN: ASCII LDH labels (IDNs in their xn-- form), no wildcard, no trailing dot."""
    if not isinstance(host, str) or not host:
        raise IssueError("server host names must be non-empty strings")
    if host.endswith("."):
        raise IssueError(f"server host {host!r} ends with a dot; write it without the trailing dot")
    if "*" in host:
        raise IssueError(f"server host {host!r}: wildcard names are not issued; list each name")
    lowered = host.lower()
    if len(lowered) > 253 or not all(_DNS_LABEL_RE.fullmatch(label) for label in lowered.split(".")):
        raise IssueError(
            f"server host {host!r} is not a valid DNS name (letters, digits and '-' in dot-separated labels "
            "of at most 63 characters; IP addresses go in the IP list)"
        )
    return lowered


def parse_ip(value: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    if not isinstance(value, str):
        raise IssueError(f"IP address must be a string, got {value!r}")
    if "%" in value:
        raise IssueError(f"IP address {value!r} has a zone index; certificates cannot carry one")
    try:
        return ipaddress.ip_address(value.strip("[]"))
    except ValueError:
        raise IssueError(f"{value!r} is not an IPv4 or IPv6 address") from None


def _looks_like_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value.strip("[]").split("%")[0])
        return True
    except ValueError:
        return False


def _dedupe(items: Iterable) -> tuple:
    return tuple(dict.fromkeys(items))


def server_request(hosts: Sequence[str], ips: Sequence[str] = (), role: str = "server") -> LeafRequest:
    """Validate server (or router) SANs. An IP literal given as a host is filed as an IP SAN,
    because a DNS SAN holding an address never matches an address being dialed."""
    if isinstance(hosts, str) or isinstance(ips, str):
        raise IssueError("hosts and ips must be lists of strings, not a single string")
    dns: list[str] = []
    addrs: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    for h in hosts:
        if isinstance(h, str) and _looks_like_ip(h):
            addrs.append(parse_ip(h))
        else:
            dns.append(validate_dns_name(h))
    addrs += [parse_ip(i) for i in ips]
    dns_t, ip_t = _dedupe(dns), _dedupe(addrs)
    if not dns_t and not ip_t:
        raise IssueError(
            f"a {role} certificate needs at least one DNS name or IP address: hostname verification "
            "ignores the common name, so clients would reject a certificate without SANs"
        )
    name = dns_t[0] if dns_t else str(ip_t[0])
    return LeafRequest(role=role, name=name, dns_names=dns_t, ips=ip_t)


def node_request(node_id: str) -> LeafRequest:
    validate_node_id(node_id)
    return LeafRequest(role="node", name=node_id, uris=(NODE_URI_PREFIX + node_id,))


def admin_request(name: str) -> LeafRequest:
    return LeafRequest(role="admin", name=validate_admin_name(name))


# ------------------------------------------------------------------ building


def _key_usage(public_key) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=isinstance(public_key, rsa.RSAPublicKey),
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=False,
        crl_sign=False,
        encipher_only=False,
        decipher_only=False,
    )


def _validity(ca: CertificateAuthority, role: str, days: int | None, now: dt.datetime | None):
    days = DEFAULT_DAYS[role] if days is None else days
    if not isinstance(days, int) or isinstance(days, bool) or days < 1:
        raise IssueError(f"validity must be a whole number of days >= 1, got {days!r}")
    now = now or utcnow()
    not_before = now - CLOCK_SKEW
    not_after = now + dt.timedelta(days=days)
    ca_end = ca.cert.not_valid_after_utc
    if not_after > ca_end:
        raise IssueError(
            f"the CA certificate expires {ca_end:%Y-%m-%d %H:%M UTC}, before this {role} certificate would "
            f"({not_after:%Y-%m-%d %H:%M UTC}); shorten the validity or rotate the CA"
        )
    return not_before, not_after


def build_leaf(
    ca: CertificateAuthority,
    req: LeafRequest,
    public_key,
    *,
    days: int | None = None,
    now: dt.datetime | None = None,
) -> x509.Certificate:
    """Sign a leaf for ``req`` over ``public_key``.

    ``now`` moves the issuing clock; it exists so that rotation drills and
    tests can mint already-expired or not-yet-valid certificates.
    """
    not_before, not_after = _validity(ca, req.role, days, now)
    ca_ski = ca.cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    builder = (
        x509.CertificateBuilder()
        .subject_name(req.subject())
        .issuer_name(ca.cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(public_key), critical=True)
        .add_extension(x509.ExtendedKeyUsage(list(ROLE_EKU[req.role])), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
    )
    names = req.general_names()
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(ca.key, hashes.SHA256())


def _issue(
    ca: CertificateAuthority, req: LeafRequest, days: int | None, key_type: str, now: dt.datetime | None
) -> tuple[bytes, bytes]:
    key: PrivateKey = generate_key(key_type)
    cert = build_leaf(ca, req, key.public_key(), days=days, now=now)
    return cert.public_bytes(serialization.Encoding.PEM), key_to_pem(key)


def issue_server(
    ca: CertificateAuthority,
    hosts: Sequence[str],
    ips: Sequence[str] = (),
    days: int | None = None,
    *,
    key_type: str = DEFAULT_KEY_TYPE,
    now: dt.datetime | None = None,
    role: str = "server",
) -> tuple[bytes, bytes]:
    """(cert_pem, key_pem) for the control plane (or, ``role="router"``, a router), valid for
    every host and IP given."""
    if role not in HOST_ROLES:
        raise IssueError(f"role {role!r} names no hosts; host roles are {', '.join(HOST_ROLES)}")
    return _issue(ca, server_request(hosts, ips, role=role), days, key_type, now)


def issue_router(ca: CertificateAuthority, hosts: Sequence[str], ips: Sequence[str] = (),
                 days: int | None = None, **kw) -> tuple[bytes, bytes]:
    """(cert_pem, key_pem) for a router: serves clients at the hosts/IPs given, reads the watch."""
    return issue_server(ca, hosts, ips, days, role="router", **kw)


def issue_engine(ca: CertificateAuthority, hosts: Sequence[str], ips: Sequence[str] = (),
                 days: int | None = None, **kw) -> tuple[bytes, bytes]:
    """(cert_pem, key_pem) for a node's engines: they serve TLS at the node's fleet address."""
    return issue_server(ca, hosts, ips, days, role="engine", **kw)


def issue_node(
    ca: CertificateAuthority,
    node_id: str,
    days: int | None = None,
    *,
    key_type: str = DEFAULT_KEY_TYPE,
    now: dt.datetime | None = None,
) -> tuple[bytes, bytes]:
    """(cert_pem, key_pem) proving the identity ``node_id`` (CN and a urn:llmgw:node: URI SAN)."""
    return _issue(ca, node_request(node_id), days, key_type, now)


def issue_admin(
    ca: CertificateAuthority,
    name: str,
    days: int | None = None,
    *,
    key_type: str = DEFAULT_KEY_TYPE,
    now: dt.datetime | None = None,
) -> tuple[bytes, bytes]:
    """(cert_pem, key_pem) for an operator."""
    return _issue(ca, admin_request(name), days, key_type, now)


# ---------------------------------------------------------------------- CSRs

_ALLOWED_CSR_EXTENSIONS = {
    ExtensionOID.SUBJECT_ALTERNATIVE_NAME,
    ExtensionOID.BASIC_CONSTRAINTS,
    ExtensionOID.KEY_USAGE,
    ExtensionOID.EXTENDED_KEY_USAGE,
    ExtensionOID.SUBJECT_KEY_IDENTIFIER,
}


def _oid_name(oid: x509.ObjectIdentifier) -> str:
    return getattr(oid, "_name", None) or oid.dotted_string


def _check_csr_key(public_key) -> None:
    if isinstance(public_key, ec.EllipticCurvePublicKey):
        if public_key.curve.name not in ("secp256r1", "secp384r1"):
            raise IssueError(f"CSR key curve {public_key.curve.name} is not accepted (use P-256 or P-384)")
    elif isinstance(public_key, rsa.RSAPublicKey):
        if public_key.key_size < 2048:
            raise IssueError(f"CSR RSA key has {public_key.key_size} bits; at least 2048 are required")
    else:
        raise IssueError(f"CSR key type {type(public_key).__name__} is not accepted (use EC P-256/P-384 or RSA)")


def _check_csr_subject(csr: x509.CertificateSigningRequest, req: LeafRequest) -> None:
    allowed = {NameOID.COMMON_NAME, NameOID.ORGANIZATION_NAME, NameOID.ORGANIZATIONAL_UNIT_NAME}
    attrs = list(csr.subject)
    extra = sorted({_oid_name(a.oid) for a in attrs if a.oid not in allowed})
    if extra:
        raise IssueError(f"CSR subject carries attributes that are not issued: {', '.join(extra)}")
    cns = [a.value for a in attrs if a.oid == NameOID.COMMON_NAME]
    if cns != [req.name]:
        shown = cns[0] if len(cns) == 1 else cns
        raise IssueError(f"CSR common name {shown!r} does not match the expected {req.role} name {req.name!r}")
    for oid, want, label in (
        (NameOID.ORGANIZATION_NAME, ORGANIZATION, "organization"),
        (NameOID.ORGANIZATIONAL_UNIT_NAME, req.role, "organizational unit"),
    ):
        values = [a.value for a in attrs if a.oid == oid]
        if values and values != [want]:
            raise IssueError(f"CSR {label} {values!r} does not match the expected {want!r}")


def _check_csr_extensions(csr: x509.CertificateSigningRequest, req: LeafRequest) -> None:
    for ext in csr.extensions:
        if ext.oid not in _ALLOWED_CSR_EXTENSIONS:
            raise IssueError(f"CSR requests extension {ext.oid.dotted_string} ({_oid_name(ext.oid)}), which is not issued")
        if isinstance(ext.value, x509.BasicConstraints) and ext.value.ca:
            raise IssueError("CSR requests a CA certificate (BasicConstraints ca=True); only leaves are issued")
        if isinstance(ext.value, x509.ExtendedKeyUsage) and set(ext.value) != set(ROLE_EKU[req.role]):
            got = ", ".join(_oid_name(o) for o in ext.value)
            want = ", ".join(_oid_name(o) for o in ROLE_EKU[req.role])
            raise IssueError(f"CSR extended key usage ({got}) does not match the {req.role} role ({want})")
    try:
        san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return
    requested = {(type(n).__name__, str(n.value)) for n in san}
    expected = {(type(n).__name__, str(n.value)) for n in req.general_names()}
    if requested != expected:
        def fmt(s: set) -> str:
            return ", ".join(f"{k}:{v}" for k, v in sorted(s)) or "none"

        raise IssueError(
            f"CSR subject alternative names ({fmt(requested)}) do not match the expected ({fmt(expected)})"
        )


def sign_csr(
    ca: CertificateAuthority,
    csr_pem: bytes,
    role: str,
    expected_name: str | None = None,
    *,
    hosts: Sequence[str] = (),
    ips: Sequence[str] = (),
    days: int | None = None,
    now: dt.datetime | None = None,
) -> bytes:
    """Sign a CSR whose key was generated elsewhere, failing closed.

    The certificate is built from what the caller expects, never copied from
    the CSR; the CSR is only checked against it. Any disagreement (another
    CN, extra subject attributes, different SANs, a CA or a different EKU
    requested, an unknown extension, a bad signature) refuses to sign.
    For ``server`` and ``router`` the expectation is ``hosts``/``ips`` (``expected_name``,
    if given, must be the first DNS name or IP); for ``node`` and ``admin``
    it is ``expected_name``.
    """
    if role not in ROLES:
        raise IssueError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
    if role in HOST_ROLES:
        req = server_request(hosts, ips, role=role)
        if expected_name is not None and expected_name != req.name:
            raise IssueError(f"expected {role} name {expected_name!r} is not the first host/IP {req.name!r}")
    elif hosts or ips:
        raise IssueError(f"{role} certificates carry no host or IP SANs")
    elif expected_name is None:
        raise IssueError(f"a {role} CSR needs the expected name to check it against")
    else:
        req = node_request(expected_name) if role == "node" else admin_request(expected_name)
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError as exc:
        raise IssueError(f"not a PEM certificate signing request ({exc})") from exc
    if not csr.is_signature_valid:
        raise IssueError("CSR signature is invalid (the request was altered or not signed by its key)")
    public_key = csr.public_key()
    _check_csr_key(public_key)
    _check_csr_subject(csr, req)
    _check_csr_extensions(csr, req)
    cert = build_leaf(ca, req, public_key, days=days, now=now)
    return cert.public_bytes(serialization.Encoding.PEM)
