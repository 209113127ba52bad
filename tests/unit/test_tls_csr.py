"""Signing CSRs fails closed on any disagreement with what is expected."""

import ipaddress

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.tls.ca import init_ca
from llmgw.tls.identity import certificate_role
from llmgw.tls.issue import IssueError, sign_csr


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    return init_ca(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def key():
    return ec.generate_private_key(ec.SECP256R1())


def make_csr(key, attrs, extensions=(), sign_key=None) -> bytes:
    b = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([x509.NameAttribute(o, v) for o, v in attrs]))
    for e, critical in extensions:
        b = b.add_extension(e, critical=critical)
    return b.sign(sign_key or key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def cn(v):
    return [(NameOID.COMMON_NAME, v)]


def test_node_csr_signed_with_own_subject_and_extensions(ca, key):
    pem = sign_csr(ca, make_csr(key, cn("gpu-a1")), "node", "gpu-a1")
    cert = x509.load_pem_x509_certificate(pem)
    assert certificate_role(cert) == "node"
    assert cert.subject.rfc4514_string() == "CN=gpu-a1,OU=node,O=llmgw"
    assert cert.public_key().public_numbers() == key.public_key().public_numbers()
    cert.verify_directly_issued_by(ca.cert)


def test_full_subject_and_matching_extensions_accepted(ca, key):
    csr = make_csr(
        key,
        [(NameOID.ORGANIZATION_NAME, "llmgw"), (NameOID.ORGANIZATIONAL_UNIT_NAME, "node"), (NameOID.COMMON_NAME, "gpu-a1")],
        [
            (x509.SubjectAlternativeName([x509.UniformResourceIdentifier("urn:llmgw:node:gpu-a1")]), False),
            (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False),
            (x509.BasicConstraints(ca=False, path_length=None), True),
        ],
    )
    sign_csr(ca, csr, "node", "gpu-a1")


@pytest.mark.parametrize("requested", ["Gpu-A1", "gpu-a1.", "gpu-a2"])
def test_node_csr_with_other_cn_refused(ca, key, requested):
    with pytest.raises(IssueError, match=f"CSR common name '{requested}' does not match the expected node name 'gpu-a1'"):
        sign_csr(ca, make_csr(key, cn(requested)), "node", "gpu-a1")


def test_two_common_names_refused(ca, key):
    with pytest.raises(IssueError, match="does not match"):
        sign_csr(ca, make_csr(key, cn("gpu-a1") + cn("gpu-a1")), "node", "gpu-a1")


def test_wrong_ou_refused(ca, key):
    csr = make_csr(key, [(NameOID.ORGANIZATIONAL_UNIT_NAME, "admin"), (NameOID.COMMON_NAME, "gpu-a1")])
    with pytest.raises(IssueError, match="organizational unit"):
        sign_csr(ca, csr, "node", "gpu-a1")


def test_extra_subject_attribute_refused(ca, key):
    csr = make_csr(key, [(NameOID.COUNTRY_NAME, "DE"), (NameOID.COMMON_NAME, "gpu-a1")])
    with pytest.raises(IssueError, match="countryName"):
        sign_csr(ca, csr, "node", "gpu-a1")


def test_ca_request_refused(ca, key):
    csr = make_csr(key, cn("gpu-a1"), [(x509.BasicConstraints(ca=True, path_length=None), True)])
    with pytest.raises(IssueError, match="CA certificate"):
        sign_csr(ca, csr, "node", "gpu-a1")


def test_other_eku_refused(ca, key):
    csr = make_csr(key, cn("gpu-a1"), [(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)])
    with pytest.raises(IssueError, match="extended key usage"):
        sign_csr(ca, csr, "node", "gpu-a1")


def test_unknown_extension_refused(ca, key):
    csr = make_csr(key, cn("gpu-a1"), [(x509.OCSPNoCheck(), False)])
    with pytest.raises(IssueError, match="not issued"):
        sign_csr(ca, csr, "node", "gpu-a1")


def test_node_csr_with_dns_san_refused(ca, key):
    csr = make_csr(key, cn("gpu-a1"), [(x509.SubjectAlternativeName([x509.DNSName("cp.example")]), False)])
    with pytest.raises(IssueError, match="subject alternative names"):
        sign_csr(ca, csr, "node", "gpu-a1")


def test_server_csr_sans_must_match_exactly(ca, key):
    good = make_csr(
        key,
        cn("cp.example"),
        [(x509.SubjectAlternativeName([x509.DNSName("cp.example"), x509.IPAddress(ipaddress.ip_address("10.0.0.1"))]), False)],
    )
    cert = x509.load_pem_x509_certificate(sign_csr(ca, good, "server", hosts=["cp.example"], ips=["10.0.0.1"]))
    assert certificate_role(cert) == "server"
    extra = make_csr(
        key,
        cn("cp.example"),
        [(x509.SubjectAlternativeName([x509.DNSName("cp.example"), x509.DNSName("evil.example")]), False)],
    )
    with pytest.raises(IssueError, match="DNSName:evil.example"):
        sign_csr(ca, extra, "server", hosts=["cp.example"], ips=["10.0.0.1"])


def test_server_csr_without_sans_gets_the_expected_ones(ca, key):
    pem = sign_csr(ca, make_csr(key, cn("cp.example")), "server", hosts=["cp.example"], ips=["10.0.0.1"])
    san = x509.load_pem_x509_certificate(pem).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["cp.example"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.1")]


def test_server_csr_needs_sans(ca, key):
    with pytest.raises(IssueError, match="at least one DNS name"):
        sign_csr(ca, make_csr(key, cn("cp.example")), "server")


def test_node_csr_needs_expected_name(ca, key):
    with pytest.raises(IssueError, match="expected name"):
        sign_csr(ca, make_csr(key, cn("gpu-a1")), "node")


def test_admin_csr(ca, key):
    pem = sign_csr(ca, make_csr(key, cn("alice")), "admin", "alice")
    assert certificate_role(x509.load_pem_x509_certificate(pem)) == "admin"
    with pytest.raises(IssueError, match="carry no host"):
        sign_csr(ca, make_csr(key, cn("alice")), "admin", "alice", hosts=["x.example"])


def test_unknown_role_refused(ca, key):
    with pytest.raises(IssueError, match="unknown role"):
        sign_csr(ca, make_csr(key, cn("gpu-a1")), "root", "gpu-a1")


def test_tampered_csr_refused(ca, key):
    pem = make_csr(key, cn("gpu-a1"))
    csr = x509.load_pem_x509_csr(pem)
    der = bytearray(csr.public_bytes(serialization.Encoding.DER))
    # flip one byte of the signature (the DER ends with it)
    der[-3] ^= 0xFF
    tampered = x509.load_der_x509_csr(bytes(der)).public_bytes(serialization.Encoding.PEM)
    with pytest.raises(IssueError, match="signature is invalid"):
        sign_csr(ca, tampered, "node", "gpu-a1")


def test_weak_keys_refused(ca):
    small = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    with pytest.raises(IssueError, match="at least 2048"):
        sign_csr(ca, make_csr(small, cn("gpu-a1")), "node", "gpu-a1")
    k1 = ec.generate_private_key(ec.SECP256K1())
    with pytest.raises(IssueError, match="curve"):
        sign_csr(ca, make_csr(k1, cn("gpu-a1")), "node", "gpu-a1")


def test_garbage_refused(ca):
    with pytest.raises(IssueError, match="not a PEM certificate signing request"):
        sign_csr(ca, b"hello", "node", "gpu-a1")


def test_router_csr_gets_both_usages_and_its_hosts(ca, key):
    pem = sign_csr(ca, make_csr(key, cn("router-1.example")), "router", hosts=["router-1.example"], ips=["10.0.0.9"])
    cert = x509.load_pem_x509_certificate(pem)
    assert certificate_role(cert) == "router"
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    with pytest.raises(IssueError, match="a router certificate needs at least one DNS name"):
        sign_csr(ca, make_csr(key, cn("router-1.example")), "router")
    server_only = make_csr(key, cn("router-1.example"),
                           [(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)])
    with pytest.raises(IssueError, match="does not match the router role"):
        sign_csr(ca, server_only, "router", hosts=["router-1.example"])
