"""The fleet CA: files, modes, extensions, refusal to overwrite, loading checks."""

import datetime as dt
import os
import stat

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from llmgw.tls.ca import CAError, CAExistsError, init_ca, load_ca


def test_init_writes_key_0600_and_cert(tmp_path):
    ca = init_ca(tmp_path / "ca")
    assert stat.S_IMODE(os.stat(tmp_path / "ca" / "ca.key").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "ca").st_mode) == 0o700
    assert (tmp_path / "ca" / "ca.crt").read_bytes() == ca.cert_pem
    assert isinstance(ca.key, ec.EllipticCurvePrivateKey) and ca.key.curve.name == "secp256r1"


def test_ca_extensions(tmp_path):
    cert = init_ca(tmp_path, common_name="test fleet CA", days=100).cert
    bc = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and bc.value.ca is True and bc.value.path_length == 0
    ku = cert.extensions.get_extension_for_class(x509.KeyUsage)
    assert ku.critical
    assert ku.value.key_cert_sign and ku.value.crl_sign
    assert not ku.value.digital_signature and not ku.value.key_encipherment
    ski = cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    aki = cert.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    assert ski.digest == x509.SubjectKeyIdentifier.from_public_key(cert.public_key()).digest
    assert aki.key_identifier == ski.digest
    assert cert.subject == cert.issuer
    assert cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value == "test fleet CA"
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert dt.timedelta(days=100) < lifetime <= dt.timedelta(days=100, minutes=6)


def test_rsa_ca(tmp_path):
    ca = init_ca(tmp_path, key_type="rsa")
    assert isinstance(ca.key, rsa.RSAPrivateKey) and ca.key.key_size == 3072


def test_unknown_key_type_refused(tmp_path):
    with pytest.raises(CAError, match="unknown key type 'dsa'"):
        init_ca(tmp_path, key_type="dsa")
    assert not (tmp_path / "ca.key").exists()


def test_existing_ca_is_not_overwritten(tmp_path):
    first = init_ca(tmp_path)
    with pytest.raises(CAExistsError, match="already exists"):
        init_ca(tmp_path)
    assert load_ca(tmp_path).cert == first.cert


def test_half_present_ca_is_not_overwritten(tmp_path):
    (tmp_path / "ca.crt").write_bytes(b"something")
    with pytest.raises(CAExistsError):
        init_ca(tmp_path)
    assert (tmp_path / "ca.crt").read_bytes() == b"something"
    assert not (tmp_path / "ca.key").exists()


def test_force_replaces(tmp_path):
    first = init_ca(tmp_path)
    second = init_ca(tmp_path, force=True)
    assert second.cert.serial_number != first.cert.serial_number
    assert load_ca(tmp_path).cert == second.cert
    assert stat.S_IMODE(os.stat(tmp_path / "ca.key").st_mode) == 0o600


def test_load_roundtrip(tmp_path):
    ca = init_ca(tmp_path)
    loaded = load_ca(tmp_path)
    assert loaded.cert == ca.cert
    assert loaded.key.private_numbers() == ca.key.private_numbers()


def test_load_missing_names_the_file_and_the_fix(tmp_path):
    with pytest.raises(CAError, match=r"ca\.key: missing; create the CA first"):
        load_ca(tmp_path)


def test_load_refuses_world_readable_key(tmp_path):
    init_ca(tmp_path)
    os.chmod(tmp_path / "ca.key", 0o644)
    with pytest.raises(CAError, match="chmod 600"):
        load_ca(tmp_path)


def test_load_refuses_key_of_another_ca(tmp_path):
    init_ca(tmp_path / "a")
    init_ca(tmp_path / "b")
    os.replace(tmp_path / "b" / "ca.key", tmp_path / "a" / "ca.key")
    with pytest.raises(CAError, match="does not belong to"):
        load_ca(tmp_path / "a")


def test_load_refuses_non_ca_certificate(tmp_path):
    from llmgw.tls.issue import issue_node

    ca = init_ca(tmp_path / "ca")
    cert_pem, key_pem = issue_node(ca, "gpu-a1")
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "ca.crt").write_bytes(cert_pem)
    (fake / "ca.key").write_bytes(key_pem)
    os.chmod(fake / "ca.key", 0o600)
    with pytest.raises(CAError, match="not a CA certificate"):
        load_ca(fake)


def test_load_refuses_garbage(tmp_path):
    init_ca(tmp_path)
    (tmp_path / "ca.crt").write_bytes(b"not pem")
    with pytest.raises(CAError, match="not a PEM certificate"):
        load_ca(tmp_path)
