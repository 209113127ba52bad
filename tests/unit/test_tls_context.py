"""SSL context settings: TLS 1.3 floor, verification on, fleet CA as the only root."""

import ssl

import pytest

from llmgw.tls.ca import init_ca
from llmgw.tls.context import TLSConfigError, client_context, server_context
from llmgw.tls.files import write_pair
from llmgw.tls.issue import issue_node, issue_server


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca = init_ca(d / "ca")
    server = write_pair(d / "server", *issue_server(ca, ["localhost"], ["127.0.0.1"]))
    node = write_pair(d / "node", *issue_node(ca, "gpu-a1"))
    return {"ca": ca.cert_path, "server": server, "node": node, "dir": d}


def only_fleet_ca(ctx: ssl.SSLContext) -> bool:
    roots = ctx.get_ca_certs()
    return len(roots) == 1 and dict(x[0] for x in roots[0]["subject"])["commonName"] == "llmgw fleet CA"


def test_server_context(pki):
    ctx = server_context(pki["ca"], *pki["server"])
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_3
    assert ctx.verify_mode == ssl.CERT_REQUIRED
    assert ctx.verify_flags & ssl.VERIFY_X509_STRICT
    assert only_fleet_ca(ctx)


def test_server_context_optional_client_cert_still_verifies_presented_ones(pki):
    ctx = server_context(pki["ca"], *pki["server"], require_client_cert=False)
    assert ctx.verify_mode == ssl.CERT_OPTIONAL


def test_client_context(pki):
    ctx = client_context(pki["ca"], *pki["node"])
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_3
    assert ctx.check_hostname is True
    assert ctx.verify_mode == ssl.CERT_REQUIRED
    assert only_fleet_ca(ctx)


def test_client_context_without_certificate(pki):
    ctx = client_context(pki["ca"])
    assert ctx.check_hostname and only_fleet_ca(ctx)


def test_client_needs_both_cert_and_key(pki):
    with pytest.raises(TLSConfigError, match="both cert_file and key_file"):
        client_context(pki["ca"], pki["node"][0])


def test_missing_ca_file_named(pki):
    with pytest.raises(TLSConfigError, match="CA file .*nope.crt does not exist"):
        client_context(pki["dir"] / "nope.crt")


def test_garbage_ca_file_named(pki):
    bad = pki["dir"] / "bad-ca.crt"
    bad.write_text("not a certificate\n")
    with pytest.raises(TLSConfigError, match="bad-ca.crt"):
        server_context(bad, *pki["server"])


def test_mismatched_key_named(pki):
    with pytest.raises(TLSConfigError, match="cannot load certificate .*server.crt with key .*node.key"):
        server_context(pki["ca"], pki["server"][0], pki["node"][1])


def test_missing_key_named(pki):
    with pytest.raises(TLSConfigError, match="missing.key does not exist"):
        server_context(pki["ca"], pki["server"][0], pki["dir"] / "missing.key")
