"""Roles and names read from peer certificates, and the checks built on them."""

import datetime as dt

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.tls.ca import init_ca
from llmgw.tls.identity import (
    IdentityError,
    PeerIdentity,
    certificate_role,
    check_admin_identity,
    check_node_identity,
    check_router_identity,
    peer_identity,
)
from llmgw.tls.issue import issue_admin, issue_node, issue_router, issue_server


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    return init_ca(tmp_path_factory.mktemp("ca"))


def der(cert_pem: bytes) -> bytes:
    return x509.load_pem_x509_certificate(cert_pem).public_bytes(serialization.Encoding.DER)


def custom(ca, attrs, usages=None) -> x509.Certificate:
    """A certificate signed by the fleet CA with an arbitrary subject and EKU."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    b = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(o, v) for o, v in attrs]))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + dt.timedelta(days=1))
    )
    if usages is not None:
        b = b.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    return b.sign(ca.key, hashes.SHA256())


OU, CN = NameOID.ORGANIZATIONAL_UNIT_NAME, NameOID.COMMON_NAME
CLIENT, SERVER = ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH


def test_node_identity_from_der(ca):
    cert_pem, _ = issue_node(ca, "gpu-a1")
    cert = x509.load_pem_x509_certificate(cert_pem)
    ident = peer_identity(der(cert_pem))
    assert ident.role == "node" and ident.name == "gpu-a1"
    assert ident.serial == cert.serial_number
    assert ident.not_after == cert.not_valid_after_utc and ident.not_after.tzinfo is not None
    assert ident.usages == ("clientAuth",)
    assert ident.fingerprint_sha256 == cert.fingerprint(hashes.SHA256()).hex()
    assert peer_identity(cert) == ident
    check_node_identity(ident, "gpu-a1")


def test_admin_and_server_roles(ca):
    assert peer_identity(der(issue_admin(ca, "alice")[0])).role == "admin"
    assert peer_identity(der(issue_server(ca, ["cp.example"], [])[0])).role == "server"


@pytest.mark.parametrize(
    "attrs, usages",
    [
        ([(OU, "node"), (CN, "gpu-a1")], [SERVER]),  # OU says node, usage says server
        ([(OU, "node"), (CN, "gpu-a1")], None),  # no EKU at all ("any" in X.509) grants nothing here
        ([(CN, "gpu-a1")], [CLIENT]),  # usage without OU
        ([(OU, "node"), (OU, "admin"), (CN, "gpu-a1")], [CLIENT]),  # ambiguous OU
        ([(OU, "Node"), (CN, "gpu-a1")], [CLIENT]),  # OU spelled differently
        ([(OU, "server"), (CN, "cp")], [CLIENT]),  # server OU without serverAuth
        ([(OU, "router"), (CN, "r1")], [CLIENT]),  # a router also serves: both usages or no role
        ([(OU, "router"), (CN, "r1")], [SERVER]),
    ],
)
def test_ou_and_eku_must_agree_for_a_role(ca, attrs, usages):
    cert = custom(ca, attrs, usages)
    assert certificate_role(cert) is None
    with pytest.raises(IdentityError, match="carries no role"):
        check_node_identity(peer_identity(cert), "gpu-a1")


def test_router_role_needs_both_usages_and_is_the_only_one_given_engine_keys(ca):
    ident = peer_identity(der(issue_router(ca, ["router-1.example"], ["10.0.0.9"])[0]))
    assert ident.role == "router" and ident.name == "router-1.example"
    assert set(ident.usages) == {"serverAuth", "clientAuth"}
    check_router_identity(ident)
    for other in (issue_admin(ca, "alice")[0], issue_node(ca, "gpu-a1")[0], issue_server(ca, ["cp"], [])[0]):
        with pytest.raises(IdentityError, match="cannot read engine keys"):
            check_router_identity(peer_identity(der(other)))
    with pytest.raises(IdentityError, match="needs OU=router with serverAuth and clientAuth"):
        check_router_identity(peer_identity(custom(ca, [(OU, "router"), (CN, "r1")], [CLIENT])))
    with pytest.raises(IdentityError, match="cannot act as an admin"):
        check_admin_identity(ident)
    with pytest.raises(IdentityError, match="cannot register as a node"):
        check_node_identity(ident, "router-1.example")


def test_node_ou_with_both_usages_is_a_node(ca):
    cert = custom(ca, [(OU, "node"), (CN, "gpu-a1")], [SERVER, CLIENT])
    assert certificate_role(cert) == "node"


@pytest.mark.parametrize("attrs, count", [([(OU, "node")], 0), ([(OU, "node"), (CN, "a"), (CN, "b")], 2)])
def test_exactly_one_cn_required(ca, attrs, count):
    with pytest.raises(IdentityError, match=f"has {count} common names"):
        peer_identity(custom(ca, attrs, [CLIENT]))


@pytest.mark.parametrize("claimed", ["Gpu-A1", "GPU-A1", "gpu-a1.", " gpu-a1", "gpu-a2", ""])
def test_node_check_is_exact_string_equality(ca, claimed):
    ident = peer_identity(der(issue_node(ca, "gpu-a1")[0]))
    with pytest.raises(IdentityError) as info:
        check_node_identity(ident, claimed)
    assert info.value.reason == f"certificate CN 'gpu-a1' does not match claimed node id {claimed!r}"


def test_reason_quotes_both_names(ca):
    ident = peer_identity(der(issue_node(ca, "gpu-a1")[0]))
    with pytest.raises(IdentityError) as info:
        check_node_identity(ident, "Gpu-A1")
    assert str(info.value) == "certificate CN 'gpu-a1' does not match claimed node id 'Gpu-A1'"


def test_admin_cannot_register_as_node(ca):
    ident = peer_identity(der(issue_admin(ca, "gpu-a1")[0]))
    with pytest.raises(IdentityError) as info:
        check_node_identity(ident, "gpu-a1")
    assert info.value.reason == "certificate role 'admin' cannot register as a node"


def test_server_cannot_register_as_node(ca):
    ident = peer_identity(der(issue_server(ca, ["gpu-a1"], [])[0]))
    with pytest.raises(IdentityError, match="certificate role 'server' cannot register as a node"):
        check_node_identity(ident, "gpu-a1")


def test_node_cannot_act_as_admin(ca):
    ident = peer_identity(der(issue_node(ca, "admin")[0]))
    with pytest.raises(IdentityError, match="certificate role 'node' cannot act as an admin"):
        check_admin_identity(ident)


def test_admin_check_accepts_admin(ca):
    check_admin_identity(peer_identity(der(issue_admin(ca, "alice")[0])))


def test_non_string_claim_refused(ca):
    ident = peer_identity(der(issue_node(ca, "gpu-a1")[0]))
    with pytest.raises(IdentityError, match="not a string"):
        check_node_identity(ident, None)


class _NoPeer:
    def getpeercert(self, binary_form=False):
        return None


def test_object_without_peer_certificate():
    with pytest.raises(IdentityError, match="presented no certificate"):
        peer_identity(_NoPeer())


def test_garbage_der_refused():
    with pytest.raises(IdentityError, match="cannot be parsed"):
        peer_identity(b"\x30\x03\x02\x01\x00")


def test_describe_is_one_line(ca):
    ident = peer_identity(der(issue_node(ca, "gpu-a1")[0]))
    assert ident.describe() == f"node 'gpu-a1' (serial {ident.serial:x})"
    assert isinstance(ident, PeerIdentity)
