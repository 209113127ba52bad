"""The router's HTTPS listener: its files are checked before anything listens, each at its pointer."""

from __future__ import annotations

import os

import pytest

from llmgw.router.serve import listener_ssl_context, tls_errors
from llmgw.router.settings import RouterSettings
from llmgw.tls import init_ca, issue_router
from llmgw.tls.files import write_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca = init_ca(d / "ca")
    return write_pair(d / "router", *issue_router(ca, ["localhost"], ["127.0.0.1"]))


def settings(cert, key) -> RouterSettings:
    return RouterSettings.from_config({"allow_unauthenticated": True, "tls": {"cert": str(cert), "key": str(key)}})


def test_a_good_pair_gives_an_https_context(pair):
    s = settings(*pair)
    assert tls_errors(s) == []
    ctx = listener_ssl_context(s)
    assert ctx is not None and ctx.minimum_version.name == "TLSv1_2"


def test_plain_http_only_where_chosen(caplog):
    s = RouterSettings.from_config({"allow_unauthenticated": True, "insecure_http": True})
    assert listener_ssl_context(s) is None
    assert "plain HTTP" in caplog.text


def test_missing_files_name_their_keys(tmp_path):
    errors = tls_errors(settings(tmp_path / "no.crt", tmp_path / "no.key"), "/router")
    assert [e.pointer for e in errors] == ["/router/tls/cert", "/router/tls/key"]


def test_a_readable_key_is_refused(pair, tmp_path):
    key = tmp_path / "router.key"
    key.write_bytes(pair[1].read_bytes())
    os.chmod(key, 0o644)
    errors = tls_errors(settings(pair[0], key))
    assert [e.pointer for e in errors] == ["/tls/key"]


def test_a_key_of_another_certificate_is_refused(pair, tmp_path):
    ca = init_ca(tmp_path / "other-ca")
    _, other_key = write_pair(tmp_path / "other", *issue_router(ca, ["localhost"]))
    errors = tls_errors(settings(pair[0], other_key))
    assert [e.pointer for e in errors] == ["/tls"] and "cannot load certificate" in errors[0].message
