"""The simulator's certificate cache: issued as ``ctl cert`` issues them, and reused on a rerun."""

from __future__ import annotations

import datetime as dt
import os
import ssl

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.sim.fleet.certs import ContextFactory, ca_fingerprint, ensure_credentials, load_credentials
from llmgw.tls.ca import init_ca
from llmgw.tls.identity import certificate_role

IDS = [f"sim-{i:05d}" for i in range(5)]


@pytest.fixture()
def ca(tmp_path):
    return init_ca(tmp_path / "ca")


def test_node_certificates_are_node_role_with_the_node_id_as_cn(tmp_path, ca) -> None:
    creds, counts = ensure_credentials(tmp_path / "cache", ca, IDS)
    assert (counts.keys_generated, counts.certs_issued) == (5, 5)
    for node_id, c in creds.items():
        cert = x509.load_pem_x509_certificate(c.cert_pem)
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == node_id
        assert certificate_role(cert) == "node"
        assert cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value == \
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH])
        assert cert.issuer == ca.cert.subject
        key = serialization.load_pem_private_key(c.key_pem, password=None)
        assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp256r1"
        assert key.public_key().public_numbers() == cert.public_key().public_numbers()
    assert os.stat(tmp_path / "cache" / "keys.json").st_mode & 0o777 == 0o600


def test_a_rerun_generates_and_issues_nothing(tmp_path, ca) -> None:
    first, _ = ensure_credentials(tmp_path / "cache", ca, IDS)
    again, counts = ensure_credentials(tmp_path / "cache", ca, IDS)
    assert (counts.keys_generated, counts.certs_issued) == (0, 0)
    assert again == first
    more, counts = ensure_credentials(tmp_path / "cache", ca, IDS + ["sim-00005"])
    assert (counts.keys_generated, counts.certs_issued) == (1, 1)
    assert load_credentials(tmp_path / "cache", ca_fingerprint(ca), IDS) == {n: first[n] for n in IDS}


def test_another_ca_signs_again_with_the_same_keys(tmp_path, ca) -> None:
    first, _ = ensure_credentials(tmp_path / "cache", ca, IDS)
    other = init_ca(tmp_path / "other-ca")
    second, counts = ensure_credentials(tmp_path / "cache", other, IDS)
    assert (counts.keys_generated, counts.certs_issued) == (0, 5)
    for n in IDS:
        assert second[n].key_pem == first[n].key_pem
        assert x509.load_pem_x509_certificate(second[n].cert_pem).issuer == other.cert.subject


def test_a_certificate_about_to_expire_is_issued_again(tmp_path, ca) -> None:
    ensure_credentials(tmp_path / "cache", ca, IDS)
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=89, hours=12)  # node certificates last 90 days
    _, counts = ensure_credentials(tmp_path / "cache", ca, IDS, now=later)
    assert (counts.keys_generated, counts.certs_issued) == (0, 5)


def test_a_corrupt_cache_is_named(tmp_path, ca) -> None:
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "keys.json").write_text("{not json")
    with pytest.raises(ValueError, match="keys.json: not a certificate cache"):
        ensure_credentials(tmp_path / "cache", ca, IDS)


def test_contexts_are_tls13_clients_and_leave_no_key_on_disk(tmp_path, ca) -> None:
    creds, _ = ensure_credentials(tmp_path / "cache", ca, IDS[:2])
    factory = ContextFactory(ca.cert_path)
    try:
        ctx = factory.context(creds[IDS[0]])
        assert ctx.minimum_version == ssl.TLSVersion.TLSv1_3 and ctx.verify_mode == ssl.CERT_REQUIRED
        assert os.listdir(factory.dir) == []
    finally:
        factory.close()
    assert not os.path.exists(factory.dir)
