"""Leaf certificates: every extension, subject, SAN rule and name rule per role."""

import datetime as dt
import ipaddress

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.tls.ca import init_ca
from llmgw.tls.issue import (
    NODE_ID_PATTERN,
    IssueError,
    issue_admin,
    issue_node,
    issue_server,
    validate_node_id,
)

SERVER_AUTH = ExtendedKeyUsageOID.SERVER_AUTH
CLIENT_AUTH = ExtendedKeyUsageOID.CLIENT_AUTH


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    return init_ca(tmp_path_factory.mktemp("ca"))


def load(cert_pem: bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(cert_pem)


def subject(cert):
    return {a.oid: a.value for a in cert.subject}


def ext(cert, cls):
    return cert.extensions.get_extension_for_class(cls)


def sans(cert):
    try:
        return list(ext(cert, x509.SubjectAlternativeName).value)
    except x509.ExtensionNotFound:
        return []


def assert_common_leaf(cert, ca, key_pem):
    bc = ext(cert, x509.BasicConstraints)
    assert bc.critical and bc.value.ca is False
    ku = ext(cert, x509.KeyUsage)
    assert ku.critical and ku.value.digital_signature
    assert not ku.value.key_cert_sign and not ku.value.crl_sign
    key = serialization.load_pem_private_key(key_pem, None)
    assert ku.value.key_encipherment == isinstance(key, rsa.RSAPrivateKey)
    ski = ext(cert, x509.SubjectKeyIdentifier).value
    assert ski.digest == x509.SubjectKeyIdentifier.from_public_key(cert.public_key()).digest
    aki = ext(cert, x509.AuthorityKeyIdentifier).value
    assert aki.key_identifier == ext(ca.cert, x509.SubjectKeyIdentifier).value.digest
    assert cert.issuer == ca.cert.subject
    cert.verify_directly_issued_by(ca.cert)
    pub = serialization.PublicFormat.SubjectPublicKeyInfo
    assert key.public_key().public_bytes(serialization.Encoding.DER, pub) == cert.public_key().public_bytes(
        serialization.Encoding.DER, pub
    )


def validity(cert) -> dt.timedelta:
    return cert.not_valid_after_utc - cert.not_valid_before_utc


# ------------------------------------------------------------------ server


def test_server_certificate(ca):
    cert_pem, key_pem = issue_server(ca, ["cp.example", "localhost"], ["127.0.0.1", "::1"])
    cert = load(cert_pem)
    assert_common_leaf(cert, ca, key_pem)
    assert list(ext(cert, x509.ExtendedKeyUsage).value) == [SERVER_AUTH]
    assert subject(cert) == {
        NameOID.ORGANIZATION_NAME: "llmgw",
        NameOID.ORGANIZATIONAL_UNIT_NAME: "server",
        NameOID.COMMON_NAME: "cp.example",
    }
    assert sans(cert) == [
        x509.DNSName("cp.example"),
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address("::1")),
    ]


def test_server_ip_given_as_host_becomes_ip_san(ca):
    cert = load(issue_server(ca, ["10.0.0.5"], [])[0])
    assert sans(cert) == [x509.IPAddress(ipaddress.ip_address("10.0.0.5"))]
    assert subject(cert)[NameOID.COMMON_NAME] == "10.0.0.5"


def test_server_ip_only(ca):
    cert = load(issue_server(ca, [], ["192.0.2.7"])[0])
    assert sans(cert) == [x509.IPAddress(ipaddress.ip_address("192.0.2.7"))]


def test_server_sans_are_deduplicated_and_lowercased(ca):
    cert = load(issue_server(ca, ["CP.example", "cp.example"], ["127.0.0.1", "127.0.0.1"])[0])
    assert sans(cert) == [x509.DNSName("cp.example"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]


def test_server_without_sans_is_refused(ca):
    with pytest.raises(IssueError, match="ignores the common name"):
        issue_server(ca, [], [])


@pytest.mark.parametrize(
    "host, message",
    [
        ("cp.example.", "trailing dot"),
        ("*.example", "wildcard"),
        ("cp_1.example", "not a valid DNS name"),
        ("-cp.example", "not a valid DNS name"),
        ("a" * 64 + ".example", "not a valid DNS name"),
        ("", "non-empty"),
    ],
)
def test_server_bad_host_refused(ca, host, message):
    with pytest.raises(IssueError, match=message):
        issue_server(ca, [host], [])


@pytest.mark.parametrize("ip, message", [("300.1.1.1", "not an IPv4 or IPv6"), ("fe80::1%eth0", "zone index")])
def test_server_bad_ip_refused(ca, ip, message):
    with pytest.raises(IssueError, match=message):
        issue_server(ca, ["cp.example"], [ip])


def test_server_hosts_as_single_string_refused(ca):
    with pytest.raises(IssueError, match="lists of strings"):
        issue_server(ca, "cp.example", [])


def test_server_default_validity_is_90_days_backdated_5_minutes(ca):
    now = dt.datetime(2030, 1, 1, 12, 0, tzinfo=dt.timezone.utc)
    cert = load(issue_server(ca, ["cp.example"], [], now=now)[0])
    assert cert.not_valid_before_utc == now - dt.timedelta(minutes=5)
    assert cert.not_valid_after_utc == now + dt.timedelta(days=90)


# -------------------------------------------------------------------- node


def test_node_certificate(ca):
    cert_pem, key_pem = issue_node(ca, "gpu-a1")
    cert = load(cert_pem)
    assert_common_leaf(cert, ca, key_pem)
    assert list(ext(cert, x509.ExtendedKeyUsage).value) == [CLIENT_AUTH]
    assert subject(cert) == {
        NameOID.ORGANIZATION_NAME: "llmgw",
        NameOID.ORGANIZATIONAL_UNIT_NAME: "node",
        NameOID.COMMON_NAME: "gpu-a1",
    }
    assert sans(cert) == [x509.UniformResourceIdentifier("urn:llmgw:node:gpu-a1")]
    assert validity(cert) == dt.timedelta(days=90, minutes=5)


def test_node_custom_validity(ca):
    assert validity(load(issue_node(ca, "gpu-a1", 7)[0])) == dt.timedelta(days=7, minutes=5)


@pytest.mark.parametrize("node_id", ["gpu-a1", "a", "gpu_a1", "rack3.gpu-07", "0", "a" * 63, ".".join(["a" * 63] * 3) + ".abc"])
def test_valid_node_ids(node_id):
    assert validate_node_id(node_id) == node_id


@pytest.mark.parametrize(
    "node_id, hint",
    [
        ("Gpu-A1", "lowercase"),
        ("gpu-a1.", "trailing dot"),
        ("-gpu", "letters, digits"),
        ("gpu-", "letters, digits"),
        ("gpu a1", "letters, digits"),
        ("gpu/a1", "letters, digits"),
        ("gpu..a1", "letters, digits"),
        (".gpu", "letters, digits"),
        ("a" * 64, "longer than 63"),
        (".".join(["a" * 63] * 4), "limit is 253"),
        ("gpu-a1\n", "letters, digits"),
        ("", "non-empty"),
    ],
)
def test_invalid_node_ids_refused(ca, node_id, hint):
    with pytest.raises(IssueError, match=hint):
        issue_node(ca, node_id)


def test_node_id_pattern_is_usable_in_json_schema():
    from jsonschema import Draft202012Validator

    v = Draft202012Validator({"type": "string", "pattern": NODE_ID_PATTERN, "maxLength": 253})
    assert v.is_valid("rack3.gpu-07")
    assert not v.is_valid("Gpu-A1") and not v.is_valid("gpu-a1.")


# ------------------------------------------------------------------- admin


def test_admin_certificate(ca):
    cert_pem, key_pem = issue_admin(ca, "alice")
    cert = load(cert_pem)
    assert_common_leaf(cert, ca, key_pem)
    assert list(ext(cert, x509.ExtendedKeyUsage).value) == [CLIENT_AUTH]
    assert subject(cert) == {
        NameOID.ORGANIZATION_NAME: "llmgw",
        NameOID.ORGANIZATIONAL_UNIT_NAME: "admin",
        NameOID.COMMON_NAME: "alice",
    }
    assert sans(cert) == []
    assert validity(cert) == dt.timedelta(days=30, minutes=5)


@pytest.mark.parametrize("name", ["", "al ice", "alice/root", "-alice", "a" * 65])
def test_admin_bad_name_refused(ca, name):
    with pytest.raises(IssueError, match="invalid admin name"):
        issue_admin(ca, name)


# ---------------------------------------------------------------- common


@pytest.mark.parametrize("days", [0, -1, 1.5, True])
def test_bad_validity_refused(ca, days):
    with pytest.raises(IssueError, match="validity"):
        issue_node(ca, "gpu-a1", days)


def test_validity_beyond_the_ca_is_refused(tmp_path):
    short_ca = init_ca(tmp_path, days=10)
    with pytest.raises(IssueError, match="rotate the CA"):
        issue_node(short_ca, "gpu-a1", 90)
    issue_node(short_ca, "gpu-a1", 5)


def test_serials_are_random_and_distinct(ca):
    serials = {load(issue_node(ca, "gpu-a1")[0]).serial_number for _ in range(5)}
    assert len(serials) == 5
    assert all(s.bit_length() > 64 for s in serials)


def test_rsa_leaf_has_key_encipherment(ca):
    cert_pem, key_pem = issue_server(ca, ["cp.example"], [], key_type="rsa-2048")
    cert = load(cert_pem)
    assert_common_leaf(cert, ca, key_pem)
    assert isinstance(cert.public_key(), rsa.RSAPublicKey)
    assert ext(cert, x509.KeyUsage).value.key_encipherment


def test_ec_leaf_has_no_key_encipherment(ca):
    cert_pem, _ = issue_node(ca, "gpu-a1")
    cert = load(cert_pem)
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    assert not ext(cert, x509.KeyUsage).value.key_encipherment


def test_leaf_from_rsa_ca(tmp_path):
    rsa_ca = init_ca(tmp_path, key_type="rsa-2048")
    cert_pem, key_pem = issue_node(rsa_ca, "gpu-a1")
    assert_common_leaf(load(cert_pem), rsa_ca, key_pem)


def test_backdated_issue_yields_expired_certificate(ca):
    past = dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=10)
    cert = load(issue_node(ca, "gpu-a1", 1, now=past)[0])
    assert cert.not_valid_after_utc < dt.datetime.now(dt.timezone.utc)
