"""The fleet's private certificate authority.

A public CA cannot serve here: public authorities no longer issue the
clientAuth usage, and node identity must be something only this fleet's
operator can grant. The CA is two files in one directory on the controller:
``ca.key`` (0600, never leaves that machine) and ``ca.crt`` (distributed to
every host as the only trust root).
"""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Union

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from .files import private_mode_problem, write_private, write_public

CA_KEY_NAME = "ca.key"
CA_CERT_NAME = "ca.crt"
ORGANIZATION = "llmgw"

PrivateKey = Union[ec.EllipticCurvePrivateKey, rsa.RSAPrivateKey]

KEY_TYPES: dict[str, tuple[str, int]] = {
    "ec-p256": ("ec", 256),
    "ec-p384": ("ec", 384),
    "rsa-2048": ("rsa", 2048),
    "rsa-3072": ("rsa", 3072),
    "rsa-4096": ("rsa", 4096),
}
KEY_TYPE_ALIASES = {"ec": "ec-p256", "rsa": "rsa-3072"}
DEFAULT_KEY_TYPE = "ec-p256"


class CAError(Exception):
    """The CA cannot be created, loaded or used; the message says which file and why."""


class CAExistsError(CAError):
    """``init_ca`` found an existing CA and was not told to replace it."""


@dataclass(frozen=True)
class CertificateAuthority:
    """A loaded CA: its certificate, its signing key and where they live."""

    cert: x509.Certificate
    key: PrivateKey
    directory: Path

    @property
    def cert_path(self) -> Path:
        return self.directory / CA_CERT_NAME

    @property
    def key_path(self) -> Path:
        return self.directory / CA_KEY_NAME

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def normalize_key_type(key_type: str) -> str:
    """Canonical key type name, or CAError listing the accepted ones."""
    kt = KEY_TYPE_ALIASES.get(key_type, key_type)
    if kt not in KEY_TYPES:
        accepted = ", ".join(sorted([*KEY_TYPES, *KEY_TYPE_ALIASES]))
        raise CAError(f"unknown key type {key_type!r}; accepted: {accepted}")
    return kt


def generate_key(key_type: str = DEFAULT_KEY_TYPE) -> PrivateKey:
    family, size = KEY_TYPES[normalize_key_type(key_type)]
    if family == "ec":
        return ec.generate_private_key(ec.SECP256R1() if size == 256 else ec.SECP384R1())
    return rsa.generate_private_key(public_exponent=65537, key_size=size)


def key_to_pem(key: PrivateKey) -> bytes:
    """Unencrypted PKCS#8 PEM; protection is the file mode (0600), not a passphrase."""
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def build_ca_certificate(
    key: PrivateKey, *, common_name: str, days: int, now: dt.datetime | None = None
) -> x509.Certificate:
    """A self-signed root that may sign leaves only (path_length=0)."""
    if days < 1:
        raise CAError(f"CA validity must be at least 1 day, got {days}")
    now = now or utcnow()
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ski, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
        .sign(key, hashes.SHA256())
    )


def init_ca(
    directory: str | os.PathLike[str],
    *,
    common_name: str = "llmgw fleet CA",
    days: int = 3650,
    key_type: str = DEFAULT_KEY_TYPE,
    force: bool = False,
) -> CertificateAuthority:
    """Create ``ca.key`` and ``ca.crt`` in ``directory``.

    An existing CA (either file present) is refused unless ``force``: replacing
    it silently would invalidate every certificate in the fleet at once.
    """
    d = Path(directory)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    key_path, cert_path = d / CA_KEY_NAME, d / CA_CERT_NAME
    if not force:
        present = [str(p) for p in (key_path, cert_path) if p.exists()]
        if present:
            raise CAExistsError(
                f"a CA already exists ({', '.join(present)}); replacing it invalidates every issued "
                "certificate; use --force (force=True) to replace it anyway"
            )
    key = generate_key(key_type)
    cert = build_ca_certificate(key, common_name=common_name, days=days)
    try:
        write_private(key_path, key_to_pem(key), overwrite=force)
        write_public(cert_path, cert.public_bytes(serialization.Encoding.PEM), overwrite=force)
    except FileExistsError as exc:  # created by someone else between the check and the write
        raise CAExistsError(f"{exc.filename or d} appeared while creating the CA; not overwriting") from exc
    return CertificateAuthority(cert=cert, key=key, directory=d)


def load_ca(directory: str | os.PathLike[str]) -> CertificateAuthority:
    """Load and sanity-check the CA in ``directory``.

    Refuses a key readable by others, a certificate that is not a CA, and a
    key that does not belong to the certificate, since each would make every
    certificate issued from it useless or unsafe.
    """
    d = Path(directory)
    key_path, cert_path = d / CA_KEY_NAME, d / CA_CERT_NAME
    for p in (key_path, cert_path):
        if not p.is_file():
            raise CAError(f"{p}: missing; create the CA first (llmgw ctl cert init --dir {d})")
    problem = private_mode_problem(key_path)
    if problem:
        raise CAError(problem)
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    except ValueError as exc:
        raise CAError(f"{cert_path}: not a PEM certificate ({exc})") from exc
    try:
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (ValueError, TypeError) as exc:
        raise CAError(f"{key_path}: not an unencrypted PEM private key ({exc})") from exc
    if not isinstance(key, (ec.EllipticCurvePrivateKey, rsa.RSAPrivateKey)):
        raise CAError(f"{key_path}: unsupported key algorithm {type(key).__name__}")
    try:
        bc = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        bc = None
    if bc is None or not bc.ca:
        raise CAError(f"{cert_path}: not a CA certificate (BasicConstraints ca=True missing)")
    pub = serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(serialization.Encoding.DER, pub) != cert.public_key().public_bytes(
        serialization.Encoding.DER, pub
    ):
        raise CAError(f"{key_path} does not belong to {cert_path} (public keys differ)")
    return CertificateAuthority(cert=cert, key=key, directory=d)
