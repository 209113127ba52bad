"""The engine role: a node's engines serve TLS with it, and it can do nothing else in the fleet."""

from __future__ import annotations

import ipaddress

import pytest
from cryptography import x509

from llmgw.tls import init_ca
from llmgw.tls.identity import certificate_role, certificate_usages
from llmgw.tls.issue import IssueError, issue_engine


def test_engine_certificate_serves_the_node_address_only(tmp_path):
    ca = init_ca(tmp_path / "ca")
    cert = x509.load_pem_x509_certificate(issue_engine(ca, [], ["10.0.0.5"])[0])
    assert certificate_role(cert) == "engine"
    assert certificate_usages(cert) == ("serverAuth",)  # no clientAuth: no stream, no watch, no admin API
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.5")]


def test_engine_certificate_needs_an_address(tmp_path):
    with pytest.raises(IssueError, match="engine certificate needs at least one"):
        issue_engine(init_ca(tmp_path / "ca"), [], [])
